"""Packaging: gwgrad imports without torch / JAX / CuPy / a GPU, and ``gwgrad.adapters`` is
found from a wheel, an editable install and a plain checkout on PYTHONPATH."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import numpy as np
import pytest

import gwgrad
import gwgrad.__main__ as gwgrad_main

ROOT = Path(__file__).resolve().parents[1]


def _numpy_only_dir(tmp_path: Path) -> Path:
    """A folder holding just NumPy (for interpreters started without site-packages)."""
    shim = tmp_path / "numpy_only"
    shim.mkdir()
    numpy_dir = Path(np.__file__).parent
    for item in numpy_dir.parent.iterdir():
        if item.name == "numpy" or item.name.startswith("numpy.libs") or item.name == "numpy_libs":
            os.symlink(item, shim / item.name)
    return shim


def _run_isolated(code: str, paths, cwd: Path, site_dirs=(), check=True):
    """Run ``code`` in a Python with no site-packages: only ``paths`` (and .pth files of
    ``site_dirs``) are importable. Its stdout; with ``check=False`` the finished process."""
    prelude = "import sys, site\n"
    prelude += "".join(f"sys.path.insert(0, {str(p)!r})\n" for p in paths)
    prelude += "".join(f"site.addsitedir({str(d)!r})\n" for d in site_dirs)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    proc = subprocess.run([sys.executable, "-S", "-c", prelude + textwrap.dedent(code)],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=120)
    if not check:
        return proc
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def _copy_project(tmp_path: Path) -> Path:
    dest = tmp_path / "project"
    dest.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", "build")
    for name in ("gwgrad", "adapters"):
        shutil.copytree(ROOT / name, dest / name, ignore=ignore)
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        if (ROOT / name).exists():
            shutil.copy(ROOT / name, dest / name)
    return dest


def _build(project: Path, hook: str, out: Path) -> Path:
    out.mkdir()
    proc = subprocess.run(
        [sys.executable, "-c",
         f"from setuptools import build_meta as b; print(b.{hook}({str(out)!r}))"],
        cwd=project, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return out / proc.stdout.strip().splitlines()[-1]


CHECK_ADAPTERS = """
import gwgrad, gwgrad.adapters
print(gwgrad.adapters.__file__)
print("torch" in sys.modules, "jax" in sys.modules, "cupy" in sys.modules)
"""


def test_import_without_optional_frameworks_or_gpu():
    code = textwrap.dedent("""
        import sys
        for name in ("torch", "jax", "jaxlib", "cupy", "cutlass"):
            sys.modules[name] = None  # any import of them now fails
        import numpy as np, gwgrad
        from benchmarks.demo import cpu_demo
        assert cpu_demo(hidden=32, intermediate=48, num_experts=3, tokens_per_expert=20)
        print("ok", gwgrad.__version__)
    """)
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "ok" in proc.stdout


def test_plain_checkout_on_pythonpath(tmp_path):
    project = _copy_project(tmp_path)
    (project / "pyproject.toml").unlink()  # nothing installed, nothing to install from
    out = _run_isolated(CHECK_ADAPTERS, [_numpy_only_dir(tmp_path), project], cwd=tmp_path)
    lines = out.splitlines()
    assert lines[0] == str(project / "adapters" / "__init__.py")
    assert lines[1] == "False False False"


def test_wheel_maps_adapters_into_the_package(tmp_path):
    project = _copy_project(tmp_path)
    wheel = _build(project, "build_wheel", tmp_path / "dist")
    names = set(zipfile.ZipFile(wheel).namelist())
    for required in ("gwgrad/__init__.py", "gwgrad/adapters/__init__.py",
                     "gwgrad/backends/reference.py", "gwgrad/spec.py"):
        assert required in names, required
    assert not any(n.startswith("adapters/") for n in names)
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    numpy_only = _numpy_only_dir(tmp_path)
    out = _run_isolated(CHECK_ADAPTERS, [numpy_only, site], cwd=tmp_path)
    assert out.splitlines()[0] == str(site / "gwgrad" / "adapters" / "__init__.py")
    # The benchmarks and the demo stay in the checkout: from the wheel alone, the command says
    # where they are instead of failing on an import.
    run_main = "import runpy; sys.argv = ['gwgrad', {!r}]; runpy.run_module('gwgrad', run_name='__main__')"
    for command in ("demo", "bench"):
        proc = _run_isolated(run_main.format(command), [numpy_only, site], cwd=tmp_path,
                             check=False)
        assert proc.returncode == 1, proc.stdout + proc.stderr
        assert f"python -m gwgrad {command}: needs gwgrad's source checkout" in proc.stderr
        assert "Traceback" not in proc.stderr


def _pip_wheel_available() -> str:
    """Why ``pip wheel --no-build-isolation`` cannot build here, or "" when it can."""
    try:
        import setuptools  # noqa: F401
    except ImportError:
        return "setuptools is not installed"
    try:
        from setuptools.command import bdist_wheel  # noqa: F401 - setuptools >= 70.1
    except ImportError:
        try:
            import wheel  # noqa: F401 - older setuptools build wheels through it
        except ImportError:
            return "neither setuptools >= 70.1 nor the wheel package"
    proc = subprocess.run([sys.executable, "-m", "pip", "--version"], capture_output=True)
    return "" if proc.returncode == 0 else "pip is not available"


def test_wheel_holds_the_library_its_adapters_and_the_license(tmp_path):
    """``pip wheel .``: the library, its adapters and LICENSE; nothing of the checkout's
    benchmarks, tools, tests, examples or docs (result files included); the version from
    gwgrad/_version.py."""
    missing = _pip_wheel_available()
    if missing:
        pytest.skip(f"cannot build a wheel here: {missing}")
    project = tmp_path / "project"  # a copy: the build writes build/ and *.egg-info into it
    shutil.copytree(ROOT, project, ignore=shutil.ignore_patterns(
        ".git", "build", "dist", "*.egg-info", "__pycache__", "*.pyc", ".pytest_cache"))
    dist = tmp_path / "dist"
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps",
                           "--no-build-isolation", "--no-cache-dir", "-q", "-w", str(dist), "."],
                          cwd=project, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (wheel,) = dist.glob("gwgrad-*.whl")
    assert wheel.name.startswith(f"gwgrad-{gwgrad.__version__}-py3-none-any")
    names = zipfile.ZipFile(wheel).namelist()
    info = f"gwgrad-{gwgrad.__version__}.dist-info/"
    for required in ("gwgrad/__init__.py", "gwgrad/_version.py", "gwgrad/__main__.py",
                     "gwgrad/adapters/__init__.py", "gwgrad/adapters/torch.py",
                     "gwgrad/adapters/jax.py", "gwgrad/adapters/cupy.py",
                     "gwgrad/backends/__init__.py", "gwgrad/kernels/config.py",
                     "gwgrad/interop/__init__.py", info + "METADATA"):
        assert required in names, required
    # setuptools >= 77 puts license files under dist-info/licenses/, older ones beside METADATA.
    assert {info + "licenses/LICENSE", info + "LICENSE"} & set(names), \
        "LICENSE is not in the wheel (is it missing from the repository root?)"
    strays = [n for n in names if not n.startswith(("gwgrad/", info))]
    assert strays == [], strays  # no benchmarks/, tools/, tests/, examples/, docs/
    assert not [n for n in names if n.endswith((".json", ".png", ".md"))
                and not n.startswith(info)], "result or doc files in the package"
    assert not [n for n in names if "/bench" in n or "/results/" in n]
    metadata_text = zipfile.ZipFile(wheel).read(info + "METADATA").decode()
    assert f"\nVersion: {gwgrad.__version__}\n" in metadata_text


def test_version_has_one_source():
    from gwgrad import _version

    assert gwgrad.__version__ == _version.__version__
    try:
        import tomllib
    except ImportError:  # Python 3.10
        tomllib = pytest.importorskip("tomli")
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" not in config["project"] and "version" in config["project"]["dynamic"]
    assert config["tool"]["setuptools"]["dynamic"]["version"] == {
        "attr": "gwgrad._version.__version__"}
    assert "__version__ = " not in (ROOT / "gwgrad" / "__init__.py").read_text()


def test_editable_install_maps_adapters(tmp_path):
    project = _copy_project(tmp_path)
    wheel = _build(project, "build_editable", tmp_path / "dist")
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    code = CHECK_ADAPTERS + """
import importlib.util
finders = [f for f in sys.meta_path if "editable" in getattr(f, "__module__", "").lower()
           or "editable" in getattr(f, "__name__", "").lower()]
mapped = [f.find_spec("gwgrad.adapters") for f in finders]
mapped = [m.origin for m in mapped if m is not None]
print(mapped[0] if mapped else "no editable finder: " + repr(sys.meta_path))
"""
    out = _run_isolated(code, [_numpy_only_dir(tmp_path)], cwd=tmp_path, site_dirs=[site])
    lines = out.splitlines()
    want = str(project / "adapters" / "__init__.py")
    assert lines[0] == want
    # Not only through the checkout fallback in gwgrad/__init__.py: the editable finder itself
    # maps gwgrad.adapters onto adapters/.
    assert lines[2] == want


def test_every_package_folder_is_listed_in_pyproject():
    try:
        import tomllib
    except ImportError:  # Python 3.10
        tomllib = pytest.importorskip("tomli")
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    listed = set(config["tool"]["setuptools"]["packages"])
    found = {".".join(p.relative_to(ROOT).parts) for p in (ROOT / "gwgrad").rglob("*")
             if p.is_dir() and p.name != "__pycache__" and any(p.glob("*.py"))}
    found.add("gwgrad")
    assert found - listed == set(), "add these to [tool.setuptools] packages"
    assert config["tool"]["setuptools"]["package-dir"]["gwgrad.adapters"] == "adapters"
    assert config["build-system"]["requires"] == ["setuptools>=64"]


def test_cli_demo_and_info():
    for command in ("demo", "info"):
        proc = subprocess.run([sys.executable, "-m", "gwgrad", command], cwd=ROOT,
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "gwgrad " + gwgrad.__version__ in proc.stdout


def test_default_command_without_gpu_runs_the_cpu_demo(monkeypatch, capsys):
    monkeypatch.setattr(gwgrad.cuda, "available", lambda: False)
    checks = []
    monkeypatch.setattr(gwgrad_main, "_compile_checks", lambda: checks.append(True))
    assert gwgrad_main.main([]) == 0
    out = capsys.readouterr().out
    assert "no CUDA GPU" in out and "cpu demo dense" in out and "OK" in out
    assert checks == [True]
    with pytest.raises(SystemExit) as exit_info:  # argparse: usage on stderr, exit code 2
        gwgrad_main.main(["nonsense"])
    assert exit_info.value.code == 2


@pytest.mark.parametrize("args,code,needle", [
    (["--help"], 0, "gwgrad: grouped weight-gradient GEMM"),
    (["--version"], 0, "gwgrad 0."),
    (["--bogus"], 2, "unrecognized arguments: --bogus"),
    (["-d", "3"], 2, "python -m gwgrad: error:"),
])
def test_command_line_is_gwgrads_own(args, code, needle):
    env = dict(os.environ, PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, "-m", "gwgrad", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == code, proc.stdout + proc.stderr
    assert needle in proc.stdout + proc.stderr
    assert "diagnostic" not in proc.stdout + proc.stderr  # not the CuTe DSL's parser


SHIELD_SCRIPT = """
import sys
from gwgrad.backends import compile_check
print(compile_check("sm_90a"))
print("argv after:", sys.argv[1:])
"""


@pytest.mark.parametrize("argv", [["-d", "3"], ["--help"], ["-diagnostic", "all"]])
def test_compiling_ignores_the_programs_command_line(tmp_path, argv):
    # The CuTe DSL parses sys.argv when it compiles; a user's own options must not reach it.
    pytest.importorskip("cutlass")
    script = tmp_path / "user_script.py"
    script.write_text(SHIELD_SCRIPT)
    env = dict(os.environ, PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, str(script), *argv], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "compile check sm_90a: Bf16Sm90Backend compiled" in proc.stdout
    assert f"argv after: {argv}" in proc.stdout  # restored for the program


def test_compile_check_reports_an_architecture_without_a_kernel(monkeypatch):
    from gwgrad import backends

    monkeypatch.delitem(backends._KERNELS, ("bf16", "sm_100a"))
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    message = backends.compile_check("sm_100a")
    assert "skipped" in message and "no bf16 kernel for sm_100a" in message
    assert os.environ["CUTE_DSL_ARCH"] == "sm_90a"  # restored


# The expert-parallel examples run in tests/test_expert_parallel.py (as here, and under torchrun,
# with other sizes and failing on purpose); not twice.
RUN_ELSEWHERE = {"torch_expert_parallel.py", "jax_expert_parallel.py"}


@pytest.mark.parametrize("example", sorted(p.name for p in (ROOT / "examples").glob("*.py")
                                           if p.name not in RUN_ELSEWHERE))
def test_examples_run_on_cpu(example):
    if example.startswith("torch"):
        pytest.importorskip("torch")
    if example.startswith("jax"):
        pytest.importorskip("jax")
    env = dict(os.environ, PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / example)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_every_example_runs_somewhere():
    examples = {p.name for p in (ROOT / "examples").glob("*.py")}
    elsewhere = (ROOT / "tests" / "test_expert_parallel.py").read_text()
    assert RUN_ELSEWHERE <= examples
    assert all(f'EXAMPLES / "{name}"' in elsewhere for name in RUN_ELSEWHERE)


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    command = 'pip install -e ".[test]" && python -m pytest -q'
    assert command in "\n".join(readme.splitlines()[:10])  # among the first lines
    assert command in (ROOT / ".ci" / "run").read_text()
