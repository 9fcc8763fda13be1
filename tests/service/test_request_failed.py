"""A request's unexpected failure: the client told INTERNAL with an incident id, the log given the
traceback under it with the request's id, shown escaped."""

from __future__ import annotations

from kvserve.model_service.engine.errors import InternalError
from kvserve.model_service.status import as_request_failed


def test_a_bug_is_logged_with_the_requests_id_under_its_incident(caplog):
    failure = as_request_failed(RuntimeError("a bug"), "building the request failed", "abc\x00\n")
    assert isinstance(failure, InternalError)
    assert f"incident {failure.incident}" in str(failure)
    line = next(r for r in caplog.records if failure.incident in r.getMessage())
    assert "request 'abc\\x00\\n'" in line.getMessage() and line.exc_info is not None
    assert "\n" not in line.getMessage()
