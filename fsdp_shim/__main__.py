from _fsdp_shim.cli import main

raise SystemExit(main())  # python -m fsdp_shim: the fsdp-shim command
