"""configure_logging: grpc.aio's ERROR and traceback for a message a departed client could not be
sent becomes one DEBUG line (any client could fill the log with them); other errors pass."""

from __future__ import annotations

import logging

from kvserve.services.plumbing.logging_setup import configure_logging


def _grpc_send_failure() -> None:
    try:
        raise RuntimeError('Failed "execute_batch"')
    except RuntimeError:
        logging.getLogger("grpc._cython.cygrpc").exception(
            "ExecuteBatchError raised in core by servicer method [%s]", "/kvserve.inference.v1.Inference/Generate")


def test_a_send_to_a_client_that_left_is_no_error(capsys):
    try:
        configure_logging("info")
        _grpc_send_failure()
        logging.getLogger("grpc._cython.cygrpc").error("another failure")   # still shown
        err = capsys.readouterr().err
        assert "ExecuteBatchError" not in err and "Traceback" not in err and "ERROR grpc._cython.cygrpc: another" in err
        configure_logging("debug")
        _grpc_send_failure()
        err = capsys.readouterr().err
        assert ("DEBUG grpc._cython.cygrpc: ExecuteBatchError raised in core by servicer method "
                "[/kvserve.inference.v1.Inference/Generate]: the client went away while a message was being sent") in err
        assert "Traceback" not in err
    finally:
        configure_logging("info")
