"""Marks this directory as gwgrad's adapters package (gwgrad/__init__.py looks for this file
before adding a plain checkout's root to ``gwgrad.__path__``)."""
