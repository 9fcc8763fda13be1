"""configure_logging: what clients cause (grpc.aio's ERROR and traceback for a message a departed
client could not be sent, uvicorn's WARNING for a malformed HTTP request) becomes one DEBUG line
(any client could fill the log with them); other records pass."""

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


def test_what_a_http_client_does_is_no_warning(capsys):
    """uvicorn's WARNING (and traceback) for each malformed request or websocket upgrade, and
    asyncio's for writes to a connection its client closed: any client could fill the log."""
    try:
        configure_logging("info")
        try:
            raise ValueError("bad bytes")
        except ValueError as exc:
            logging.getLogger("uvicorn.error").warning("Invalid HTTP request received.", exc_info=exc)
        logging.getLogger("uvicorn.error").warning("Unsupported upgrade request.")
        logging.getLogger("asyncio").warning("socket.send() raised exception.")
        logging.getLogger("uvicorn.error").warning("something else")   # still shown
        err = capsys.readouterr().err
        assert "Invalid HTTP" not in err and "upgrade" not in err and "socket.send" not in err and "Traceback" not in err
        assert "WARNING uvicorn.error: something else" in err
        configure_logging("debug")
        logging.getLogger("uvicorn.error").warning("Unsupported upgrade request.")
        assert "DEBUG uvicorn.error: Unsupported upgrade request.: a client's request" in capsys.readouterr().err
    finally:
        configure_logging("info")


def test_json_lines_and_a_source_name_for_a_log_pipeline(capsys):
    """Every line was text with a local time and no name of the process: under `kvserve up
    --workers 2` two workers' lines could not be told apart, and a pipeline needed a pattern."""
    import json

    try:
        configure_logging("info", "json", "worker-1")
        try:
            raise ValueError("bad")
        except ValueError:
            logging.getLogger("kvserve.x").exception("it failed: %s", "line one\nline two")
        [line] = capsys.readouterr().err.splitlines()
        entry = json.loads(line)
        assert (entry["level"], entry["logger"], entry["source"]) == ("ERROR", "kvserve.x", "worker-1")
        assert entry["message"] == "it failed: line one\nline two" and "ValueError: bad" in entry["exception"]
        assert entry["time"].endswith("Z")
        configure_logging("info", "text", "worker-1/kvcache")
        logging.getLogger("kvserve.x").info("hello")
        assert " INFO [worker-1/kvcache] kvserve.x: hello" in capsys.readouterr().err
    finally:
        configure_logging("info")


def test_kvserve_up_names_each_childs_log_lines(tmp_path, monkeypatch):
    from kvserve.model_service.config import ModelServiceConfig
    from kvserve.services.cli import up

    monkeypatch.setattr(up.Child, "start", lambda self: None)
    pair = up.Pair.make("worker-1", ["kvserve", "--log-format", "json"], ModelServiceConfig(model="tiny"), tmp_path,
                        None, None)
    pair.start_manager(["kvserve", "--log-format", "json"], {"num_pages": 64, "page_size": 16}, None)
    for child, source in ((pair.model, "worker-1"), (pair.manager, "worker-1/kvcache")):
        argv = child.argv
        assert argv[argv.index("--log-source") + 1] == source and "--log-format" in argv
