"""The connector's link to the daemon: how long a daemon found away is left alone."""

from __future__ import annotations

import logging

from kvtier.errors import DeadlineExceeded, Unavailable
from kvtier.integrations.vllm.link import DaemonLink


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def waits(link: DaemonLink, clock: Clock) -> float:
    """How long from now until the link tries the daemon again."""
    start = clock.now
    while not link.ready():
        clock.now += 0.25
    waited, clock.now = clock.now - start, start
    return waited


def test_a_daemon_that_does_not_answer_is_left_longer_than_one_that_is_gone() -> None:
    """A hung daemon (stopped, not gone) costs each try the whole client timeout: retried every
    2 s, a scheduler's lookups waited 5 s of every 7. Timeouts back off from 5 s to 30 s; a
    refused connection (a restart under way) still retries from 0.5 s to 2 s."""
    clock = Clock()
    link = DaemonLink(lambda: None, "scheduler", logging.getLogger("test"), clock=clock)
    link.failed(DeadlineExceeded("timed out"))
    assert waits(link, clock) == 5.0
    for want in (10.0, 20.0, 30.0, 30.0):
        link.failed(DeadlineExceeded("timed out"))
        assert waits(link, clock) == want
    link.failed(Unavailable("connection refused"))  # killed: back soon, tried often
    assert waits(link, clock) == 2.0
    link.ok()
    link.failed(Unavailable("connection refused"))
    assert waits(link, clock) == 0.5
    assert link.outages == 2
