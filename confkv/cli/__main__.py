"""``python -m confkv.cli``: the ``confkv`` command."""

from confkv.cli.main import main

raise SystemExit(main())
