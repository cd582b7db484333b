"""Without a GPU every Triton kernel runs in the Triton interpreter. The switch must happen before
anything (torch.compile's inductor included) imports triton, so it lives here, the first file pytest
loads."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
