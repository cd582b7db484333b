"""data/prefetch.py: the prefetched batches and checkpoint states are exactly the wrapped
loader's."""

from __future__ import annotations

import time

import pytest
import torch

from titan_glm52.data import Prefetcher, build_dataloader, build_tokenizer


def _loader(seq_len=96, batch=2, **kw):
    return build_dataloader(build_tokenizer("embedded"), "embedded", seq_len, batch, seed=3, **kw)


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("depth", [1, 3])
def test_same_batches_and_states_as_the_loader(depth):
    plain, pre = _loader(), Prefetcher(_loader(), depth)
    assert pre.state_dict() == plain.state_dict()
    for _ in range(7):
        assert _equal(next(pre), next(plain))
        # let the thread run ahead: the state is still that of the last batch handed out
        time.sleep(0.01)
        assert pre.state_dict() == plain.state_dict()
    pre.close()


def test_resume_mid_stream_and_after_close():
    plain = _loader()
    ref = [next(plain) for _ in range(9)]
    pre = Prefetcher(_loader(), 2)
    for i in range(4):
        assert _equal(next(pre), ref[i])
    state = pre.state_dict()
    # a new prefetcher on a fresh loader, resumed from that state, continues with batch 4
    other = Prefetcher(_loader(), 2)
    other.load_state_dict(state)
    assert other.state_dict() == state
    for i in range(4, 7):
        assert _equal(next(other), ref[i])
    # load_state_dict while running rewinds the stream
    other.load_state_dict(state)
    assert _equal(next(other), ref[4])
    # close() drops what was made ahead and puts the loader back: next() continues exactly
    pre.close()
    assert pre.loader.state_dict() == state
    for i in range(4, 9):
        assert _equal(next(pre), ref[i])
    pre.close()
    other.close()


def test_end_and_errors_reach_the_consumer():
    finite = _loader(seq_len=4096, batch=8, infinite=False)
    n = sum(1 for _ in finite)
    pre = Prefetcher(_loader(seq_len=4096, batch=8, infinite=False), 2)
    assert sum(1 for _ in pre) == n and n > 0
    with pytest.raises(StopIteration):
        next(pre)

    class Broken:
        def state_dict(self):
            return {"i": 0}

        def __next__(self):
            raise ValueError("bad shard")

    with pytest.raises(ValueError, match="bad shard"):
        next(Prefetcher(Broken()))
    with pytest.raises(ValueError, match="depth"):
        Prefetcher(Broken(), 0)
