"""`python -m megatron_async ...` is the same as the `megatron-async` command."""
import sys

from megatron_async.cli import main

if __name__ == "__main__":
    sys.exit(main())
