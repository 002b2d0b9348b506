"""Counts of a run of cuDNN frontend's published wgrad tests (run.sh), from pytest's JUnit XML:
passed / skipped / failed, each skip reason with its count, and the tests' commit.

    python tools/cudnn_published/summary.py junit.xml COMMIT out.json
"""

import collections
import json
import sys
import xml.etree.ElementTree as ET


def summarize(junit_path: str, commit: str) -> dict:
    counts = {"passed": 0, "skipped": 0, "failed": 0}
    reasons = collections.Counter()
    failures = []
    for case in ET.parse(junit_path).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        skipped = case.find("skipped")
        failed = case.find("failure") if case.find("failure") is not None else case.find("error")
        if failed is not None:
            counts["failed"] += 1
            failures.append({"test": name, "message": (failed.get("message") or "")[:300]})
        elif skipped is not None:
            counts["skipped"] += 1
            reasons[(skipped.get("message") or "").split(": ", 1)[-1][:160]] += 1
        else:
            counts["passed"] += 1
    return {"tests_commit": commit, **counts, "skip_reasons": dict(reasons.most_common()),
            "failures": failures}


if __name__ == "__main__":
    junit, commit, out = sys.argv[1:4]
    result = summarize(junit, commit)
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"cuDNN frontend tests at {commit}: {result['passed']} passed, "
          f"{result['skipped']} skipped, {result['failed']} failed")
