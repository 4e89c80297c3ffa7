"""`python -m resnet18_kit`: the same command as `resnet18-kit` (resnet18_kit.cli)."""
import sys

from resnet18_kit.cli import main

if __name__ == "__main__":
    sys.exit(main())
