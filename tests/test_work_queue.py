"""The driver's queue of a cell's problems over the Ray actors: handed out in order, a dead actor's problems
requeued, a problem part of two deaths recorded as failed."""

from collections import deque

from kvrescue.data import Problem
from kvrescue.work_queue import WorkQueue


def problem(idx: int) -> Problem:
    return Problem(idx, f"p{idx}", "1", {})


def test_queue_hands_out_in_order_and_requeues_a_dead_workers_problems():
    queue = WorkQueue(deque(problem(i) for i in range(4)))
    assert [queue.take(0).idx, queue.take(1).idx, queue.take(0).idx] == [0, 1, 2]
    queue.done(0, 0)
    assert queue.lost(0, "killed by SIGKILL") == []
    assert [p.idx for p in queue.pending] == [2, 3] and queue.strikes[2] == 1
    # 2 was in flight when a worker died: it now goes alone to a worker holding nothing
    assert queue.take(1).idx == 3  # worker 1 still holds 1, so it gets no suspect
    assert queue.take(1) is None
    assert queue.take(2).idx == 2 and queue.take(2) is None  # alone, and nothing joins it
    assert queue.lost(2, "CUDA error") == [problem(2)]  # its second death: failed
    assert queue.errors[2] == ["killed by SIGKILL", "CUDA error"]
    queue.done(1, 1)
    queue.done(1, 3)
    assert queue.empty
