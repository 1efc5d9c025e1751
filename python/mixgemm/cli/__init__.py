"""The ``mixgemm`` command line: :mod:`.main` parses, one module per command."""
