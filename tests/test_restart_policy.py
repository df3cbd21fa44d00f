"""The supervisor's restart policy (daemon/restart_policy.py): backoff, crash-loop breaker,
config errors never retried."""

from __future__ import annotations

import random

from mlxd.daemon.restart_policy import RestartPolicy
from mlxd.protocol import exit_codes


def test_restart_policy_backs_off_then_breaks_a_crash_loop():
    p = RestartPolicy(base_delay=1, max_delay=8, jitter=0, loop_crashes=4, loop_window=60)
    delays = [p.after_exit(1, t)[1] for t in (0, 1, 2)]
    assert delays == [1, 2, 4]
    assert p.after_exit(1, 3) == ("failed", 0.0)
    p.reset()
    assert p.after_exit(-9, 100)[0] == "restart"


def test_restart_policy_forgets_old_crashes_and_never_retries_config_errors():
    p = RestartPolicy(base_delay=1, jitter=0.2, loop_crashes=3, loop_window=10)
    for t in (0, 20, 40, 60):
        verdict, delay = p.after_exit(1, t, random.Random(t))
        assert verdict == "restart" and 0.8 <= delay <= 1.2
    assert p.after_exit(exit_codes.CONFIG_ERROR, 61) == ("failed", 0.0)


def test_without_the_breaker_a_crash_loop_only_stretches_the_backoff():
    p = RestartPolicy(base_delay=1, max_delay=8, jitter=0, loop_crashes=3, loop_window=60,
                      breaker=False)
    assert [p.after_exit(-9, t) for t in range(6)] == [
        ("restart", 1), ("restart", 2), ("restart", 4), ("restart", 8), ("restart", 8),
        ("restart", 8)]
    assert p.after_exit(exit_codes.CONFIG_ERROR, 7) == ("failed", 0.0)  # it cannot run at all


def test_deaths_after_progress_are_restarted_at_the_base_delay_and_never_parked():
    p = RestartPolicy(base_delay=1, max_delay=8, jitter=0, loop_crashes=3, loop_window=60)
    assert [p.after_exit(-9, t, progressed=True) for t in range(10)] == [("restart", 1)] * 10
    assert p.loop_length == 1


def test_a_loop_is_the_deaths_since_the_last_progress():
    p = RestartPolicy(base_delay=1, max_delay=8, jitter=0, loop_crashes=3, loop_window=60)
    assert p.after_exit(1, 0) == ("restart", 1)
    assert p.after_exit(1, 1) == ("restart", 2)
    assert p.after_exit(-9, 2, progressed=True) == ("restart", 1)  # the loop is broken
    assert p.after_exit(1, 3) == ("restart", 2)
    assert p.after_exit(1, 4) == ("failed", 0.0)  # three deaths since the last progress


def test_a_model_that_dies_at_every_load_is_parked_after_five():
    p = RestartPolicy(base_delay=0.1, jitter=0)
    verdicts = [p.after_exit(1, t * 0.5)[0] for t in range(5)]
    assert verdicts == ["restart"] * 4 + ["failed"]


def test_progress_does_not_excuse_a_configuration_error():
    p = RestartPolicy()
    assert p.after_exit(exit_codes.CONFIG_ERROR, 0, progressed=True) == ("failed", 0.0)


def test_a_child_ending_by_a_crash_while_stopping_is_worth_a_warning():
    """The supervisor's stop: a crash of a child told to stop is logged (the tests'
    `stop_and_check` fails on it); a clean exit, a model that could not load and the
    supervisor's own SIGKILL past a grace are reported elsewhere."""
    import signal

    from mlxd.daemon.supervisor import unclean_stop
    from mlxd.protocol import exit_codes
    assert unclean_stop(-signal.SIGABRT) and unclean_stop(-signal.SIGSEGV)
    assert unclean_stop(exit_codes.CRASH)
    assert not unclean_stop(exit_codes.OK)
    assert not unclean_stop(exit_codes.CONFIG_ERROR)
    assert not unclean_stop(-signal.SIGKILL)
    assert not unclean_stop(-signal.SIGTERM) and not unclean_stop(-signal.SIGINT)
