"""SIGTERM and SIGUSR1 stop a command as Ctrl-C does (`stopping`): raised as a KeyboardInterrupt naming the signal,
or, deferred, recorded for the next safe point; the exit status is 128 + the signal's number."""

from __future__ import annotations

import os
import signal

import pytest

from chatglm_tune.runtime.stopping import Stopped, exit_status, signal_name, signals_stop


@pytest.mark.parametrize("name", ["SIGINT", "SIGTERM", "SIGUSR1"])
def test_each_stop_signal_raises_a_keyboard_interrupt_naming_it(name):
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(KeyboardInterrupt) as raised, signals_stop():
        os.kill(os.getpid(), getattr(signal, name))
        for _ in range(1000):  # the handler runs at the next bytecode
            pass
    assert isinstance(raised.value, Stopped) and signal_name(raised.value) == name
    assert exit_status(raised.value) == 128 + getattr(signal, name)
    assert signal.getsignal(signal.SIGTERM) is before


def test_deferred_records_the_first_signal_and_raises_at_the_second():
    with signals_stop(deferred=True) as request:
        os.kill(os.getpid(), signal.SIGTERM)
        assert request.signal_name == "SIGTERM"
        with pytest.raises(Stopped) as raised:
            os.kill(os.getpid(), signal.SIGINT)
            for _ in range(1000):
                pass
        assert raised.value.signal_name == "SIGINT"


def test_pythons_own_ctrl_c_is_sigint():
    assert signal_name(KeyboardInterrupt()) == "SIGINT" and exit_status(KeyboardInterrupt()) == 130
    assert exit_status("SIGTERM") == 143 and exit_status("SIGUSR1") == 138


def test_a_crash_point_is_parsed_with_its_rank_and_a_bad_one_is_named():
    from chatglm_tune.runtime import crashpoints

    assert crashpoints.parse(crashpoints.spell("train-step", 2, "SIGTERM", 1)) == ("train-step", 2, "SIGTERM", 1)
    assert crashpoints.parse("append#3:SIGKILL") == ("append", 3, "SIGKILL", None)
    with pytest.raises(ValueError, match="CHATGLM_TUNE_CRASH_AT='append#0:SIGKILL'"):
        crashpoints.parse("append#0:SIGKILL")
