"""`python -m bench.gpu`: runs bench/gpu/main.py."""

from bench.gpu.main import main

raise SystemExit(main())
