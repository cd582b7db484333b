"""Entry point: ``torchrun --nproc_per_node N train.py --job.config_file
train_configs/glm52_debug.toml [...]``."""

import sys

from titan_glm52.trainer import main

if __name__ == "__main__":
    main(sys.argv[1:])
