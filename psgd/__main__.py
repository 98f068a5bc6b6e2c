from .cli import main

raise SystemExit(main(own_process=True))
