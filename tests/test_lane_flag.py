"""The lanes' one-shot flag (xsched.execute.workers.Flag), which Done uses in place of threading.Event: waiters on
other threads block until it is set and all go on once it is, a second set is harmless, and a failed task's Done
still releases the steps waiting for it."""

from __future__ import annotations

import threading

from xsched.execute.workers import Done, Flag, Lane, Task


def test_waiters_block_until_set_then_all_go_on() -> None:
    flag = Flag()
    gone: list[int] = []
    started = threading.Barrier(4)

    def waiter(k: int) -> None:
        started.wait()
        flag.wait()
        gone.append(k)

    threads = [threading.Thread(target=waiter, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    started.wait()
    assert not flag.is_set()
    for t in threads:
        t.join(0.05)
    assert all(t.is_alive() for t in threads)  # still waiting: the flag is not set
    assert gone == []
    flag.set()
    for t in threads:
        t.join(10)
    assert sorted(gone) == [0, 1, 2] and flag.is_set()
    flag.set()  # set again: no error
    flag.wait()  # a set flag is passed at once


def test_a_failed_task_releases_its_dependants() -> None:
    lane = Lane("host:test", "host")
    errors: list = []
    first, second = Done(), Done()

    def fail(_: object) -> None:
        raise ValueError("boom")

    ran: list[str] = []
    lane.submit([Task(0, fail, None, [], first, errors)])
    lane.submit([Task(1, lambda _: ran.append("second"), None, [first], second, errors)])
    second.event.wait()
    lane.close()
    assert first.failed and second.failed and ran == []  # the dependant is skipped, not hung
    assert [(i, type(e).__name__) for i, e in errors] == [(0, "ValueError")]
