"""The spawned-ranks driver of the multi-process GPU tests (spawned.py), on the CPU."""

import os

import pytest

from spawned import run_ranks


def _fine(rank, results):
    results.put((rank, "ok"))


def _rank_one_fails(rank, results):
    results.put((rank, "ok" if rank != 1 else "Traceback: rank 1 broke"))


def _rank_one_dies(rank, results):
    if rank == 1:
        os._exit(3)
    results.put((rank, "ok"))


def test_every_rank_ok():
    run_ranks(_fine, 3, timeout_s=60)


def test_a_failing_rank_is_named_with_its_report():
    with pytest.raises(AssertionError, match="rank 1:\nTraceback: rank 1 broke"):
        run_ranks(_rank_one_fails, 3, timeout_s=60)


def test_a_rank_that_dies_is_named_with_its_exit_code():
    with pytest.raises(AssertionError, match=r"rank 1:\nno report \(exit code 3\)"):
        run_ranks(_rank_one_dies, 2, timeout_s=60)
