"""`pagedserve run-batch` against the fake engine: every line answered in input order through the
server's own routes (its refusals as that line's error), lines the server cannot take now (429)
retried, the whole file's envelope checked before any model loads, and nothing written when the
run fails. The real model answers a file in tests/server/test_e2e_run_batch.py."""

from __future__ import annotations

import asyncio
import http.server
import json
import logging
import threading
from pathlib import Path

import pytest

from pagedserve.server.app import create_app
from pagedserve.server.cli import _largest_body, main
from pagedserve.server.run_batch import (
    BatchInputError,
    BatchRequestInput,
    UploadError,
    read_batch,
    run_batch,
)
from tests.server.conftest import FakeEngine, make_config

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def _line(custom_id: str, url: str, body: dict, method: str = "POST") -> str:
    return json.dumps({"custom_id": custom_id, "method": method, "url": url, "body": body})


def _run(tmp_path: Path, lines: list[str], engine: FakeEngine, **settings) -> list[dict]:
    source, target = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("\n".join(lines) + "\n")
    app = create_app(make_config(**settings), engine)
    failed = asyncio.run(
        run_batch(app, read_batch(str(source)), str(target), settings.get("api_key"))
    )
    answers = [json.loads(line) for line in target.read_text().splitlines()]
    assert failed == sum(answer["response"]["status_code"] != 200 for answer in answers)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl", "out.jsonl"]  # no temp
    return answers


def test_every_line_is_answered_in_input_order_by_the_server_s_routes(tmp_path, engine):
    lines = [
        _line("chat", "/v1/chat/completions", CHAT),
        _line("text", "/v1/completions", {"prompt": "hi", "max_tokens": 3}),
        "",
        _line("sglang", "/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 1}}),
        _line("embed", "/v1/embeddings", {"input": "hi"}),
    ]
    answers = _run(tmp_path, lines, engine)
    assert [answer["custom_id"] for answer in answers] == ["chat", "text", "sglang", "embed"]
    assert all(answer["response"]["status_code"] == 200 for answer in answers)
    assert all(answer["error"] is None for answer in answers)
    assert answers[0]["response"]["body"]["choices"][0]["message"]["content"] == "ab"
    assert answers[1]["response"]["body"]["choices"][0]["text"] == "abc"
    assert answers[2]["response"]["body"]["text"] == "a"
    assert answers[3]["response"]["body"]["data"][0]["embedding"]
    for answer in answers:  # the server's request id, which its log lines carry
        assert answer["id"].startswith("batch_req_") and len(answer["response"]["request_id"]) == 32


def test_refused_lines_carry_the_server_s_error_and_the_run_goes_on(tmp_path, engine):
    lines = [
        _line("bad-value", "/v1/completions", {"prompt": "hi", "temperature": -1}),
        _line("no-route", "/v1/images/generations", {"prompt": "a cat"}),
        _line("streamed", "/v1/chat/completions", {**CHAT, "stream": True}),
        _line("background", "/v1/responses", {"input": "hi", "background": True}),
        _line("unknown-model", "/v1/chat/completions", {**CHAT, "model": "other"}),
        _line("fine", "/v1/chat/completions", CHAT),
    ]
    answers = _run(tmp_path, lines, engine)
    statuses = [answer["response"]["status_code"] for answer in answers]
    assert statuses == [400, 400, 400, 400, 404, 200]
    assert answers[3]["error"]["error"]["param"] == "background"
    assert answers[0]["error"]["error"]["param"] == "temperature"
    assert answers[0]["response"]["body"] is None
    assert "not supported" in answers[1]["error"]["error"]["message"]
    assert answers[2]["error"]["error"]["param"] == "stream"  # the server's error shape, always
    assert answers[4]["error"]["error"]["code"] == "model_not_found"
    assert len(engine.requests) == 1  # only the last line reached the engine


def test_lines_beyond_what_the_server_admits_wait_and_all_succeed(tmp_path, engine, caplog):
    # 12 lines of 3 prompts: far more engine requests than the fake's 8 in flight (a 429).
    body = {"prompt": ["a", "b", "c"], "max_tokens": 2}
    lines = [_line(f"r{i}", "/v1/completions", body) for i in range(12)]
    with caplog.at_level(logging.INFO, logger="pagedserve.server.run_batch"):
        answers = _run(tmp_path, lines, engine)
    assert [answer["response"]["status_code"] for answer in answers] == [200] * 12
    assert len(engine.requests) > 36  # the fake records refused tries too: some were retried
    assert "run-batch: 12/12 requests done (100%" in caplog.text


def test_the_api_key_the_server_asks_for_is_sent(tmp_path, engine):
    answers = _run(tmp_path, [_line("a", "/v1/chat/completions", CHAT)], engine, api_key="k")
    assert answers[0]["response"]["status_code"] == 200


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ("{not json", ":2: the line: Invalid JSON"),
        (_line("x", "/v1/completions", {}, method="GET"), ":2: method: Input should be 'POST'"),
        (json.dumps({"method": "POST", "url": "/v1/completions", "body": {}}), ":2: custom_id"),
        (_line("first", "/v1/completions", {}), ":2: custom_id 'first' repeats"),
        (json.dumps({"custom_id": "y", "method": "POST", "url": "/x", "body": []}), ":2: body"),
    ],
)
def test_a_malformed_line_stops_the_run_naming_it(tmp_path, line, expected):
    source = tmp_path / "in.jsonl"
    source.write_text(_line("first", "/v1/completions", {}) + "\n" + line + "\n")
    with pytest.raises(BatchInputError) as error:
        read_batch(str(source))
    assert expected in str(error.value)


def test_the_command_checks_the_file_before_loading_the_model(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(
        "pagedserve.server.cli._run_batch", lambda *args: pytest.fail("the model was loaded")
    )
    source = tmp_path / "in.jsonl"
    source.write_text('{"custom_id": 1}\n')
    for output in (tmp_path / "out.jsonl", tmp_path / "missing" / "out.jsonl"):
        with pytest.raises(SystemExit) as exit_info:
            main(["run-batch", "-i", str(source), "-o", str(output)])
        assert exit_info.value.code == 2
    errors = capsys.readouterr().err
    assert "in.jsonl:1: custom_id" in errors and "folder does not exist" in errors
    assert not (tmp_path / "out.jsonl").exists()


def test_an_engine_that_does_not_start_leaves_no_output(tmp_path, engine):
    async def broken_start() -> None:
        raise RuntimeError("no model")

    engine.start = broken_start  # type: ignore[method-assign]
    (tmp_path / "out.jsonl").write_text("an earlier run's answers\n")
    source = tmp_path / "in.jsonl"
    source.write_text(_line("a", "/v1/chat/completions", CHAT) + "\n")
    app = create_app(make_config(), engine)
    with pytest.raises(RuntimeError, match="no model"):
        asyncio.run(run_batch(app, read_batch(str(source)), str(tmp_path / "out.jsonl"), None))
    assert (tmp_path / "out.jsonl").read_text() == "an earlier run's answers\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl", "out.jsonl"]


def _answers(path: Path) -> list[dict]:
    # "\n" only: the answers may hold U+2028, which str.splitlines() would split at
    return [json.loads(line) for line in path.read_text().split("\n") if line]


def test_lines_the_server_refuses_or_fails_do_not_stop_the_run(tmp_path, engine):
    unescaped = {"custom_id": "sep\u2028arated", "method": "POST", "url": "/v1/completions"}
    unescaped["body"] = {"prompt": "a\u2028b", "max_tokens": 1}
    lines = [
        '{"custom_id": "nan", "method": "POST", "url": "/v1/completions", '
        '"body": {"prompt": "hi", "temperature": NaN}}',
        json.dumps(unescaped, ensure_ascii=False),  # U+2028 as it is, not escaped
        _line("beams", "/v1/completions", {"prompt": ["a"] * 5, "use_beam_search": True, "n": 2}),
    ]
    source, target = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("\n".join(lines) + "\n")
    app = create_app(make_config(), engine)
    asyncio.run(run_batch(app, read_batch(str(source)), str(target), None))
    answers = _answers(target)
    statuses = {answer["custom_id"]: answer["response"]["status_code"] for answer in answers}
    # NaN reaches the server (a 400 naming it); U+2028 is no line break; 5 prompts x 2 beams
    # never fit the fake's 8 in flight: a 400 at once, not a 429 retried forever.
    assert statuses == {"nan": 400, "sep\u2028arated": 200, "beams": 400}
    assert answers[0]["error"]["error"]["param"] == "temperature"
    assert "needs 10 engine requests" in answers[2]["error"]["error"]["message"]
    engine.raise_on_generate = RuntimeError("a bug")  # each route fails: each line's 500
    failed = asyncio.run(run_batch(app, read_batch(str(source)), str(target), None))
    assert failed == 3 and _answers(target)[1]["response"]["status_code"] == 500


def test_the_output_keeps_the_replaced_file_s_mode_and_a_symlink_s_target(tmp_path, engine):
    target = tmp_path / "results" / "out.jsonl"
    target.parent.mkdir()
    target.write_text("old\n")
    target.chmod(0o640)
    link = tmp_path / "link.jsonl"
    link.symlink_to(target)
    source = tmp_path / "in.jsonl"
    source.write_text(_line("a", "/v1/chat/completions", CHAT) + "\n")
    app = create_app(make_config(), engine)
    asyncio.run(run_batch(app, read_batch(str(source)), str(link), None))
    assert link.is_symlink() and json.loads(target.read_text())["custom_id"] == "a"
    assert target.stat().st_mode & 0o777 == 0o640
    assert sorted(p.name for p in target.parent.iterdir()) == ["out.jsonl"]


def test_an_output_that_is_a_folder_is_refused_before_loading(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(
        "pagedserve.server.cli._run_batch", lambda *args: pytest.fail("the model was loaded")
    )
    source = tmp_path / "in.jsonl"
    source.write_text(_line("a", "/v1/chat/completions", CHAT) + "\n")
    with pytest.raises(SystemExit) as exit_info:
        main(["run-batch", "-i", str(source), "-o", str(tmp_path)])
    assert exit_info.value.code == 2 and "is a folder" in capsys.readouterr().err


class _ObjectStore(http.server.BaseHTTPRequestHandler):
    """GET serves `files`, PUT stores the body under the path (`failures` PUTs answer 500 first)."""

    files: dict[str, bytes] = {}
    failures = 0

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        body = self.files.get(self.path)
        self.send_response(200 if body is not None else 404)
        self.end_headers()
        self.wfile.write(body or b"")

    def do_PUT(self) -> None:  # noqa: N802
        data = self.rfile.read(int(self.headers["Content-Length"]))
        if _ObjectStore.failures:
            _ObjectStore.failures -= 1
            self.send_response(500)
        else:
            self.files[self.path] = data
            self.send_response(200)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def object_store():
    _ObjectStore.files, _ObjectStore.failures = {}, 0
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _ObjectStore)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_input_and_output_may_be_urls_as_in_vllm(object_store, engine, monkeypatch):
    monkeypatch.setattr("pagedserve.server.run_batch.UPLOAD_RETRY_S", 0.0)
    lines = [
        _line("a", "/v1/chat/completions", CHAT),
        _line("b", "/v1/completions", {"prompt": "x"}),
    ]
    _ObjectStore.files["/in.jsonl"] = ("\n".join(lines) + "\n").encode()
    _ObjectStore.failures = 2  # the upload is tried again
    requests = read_batch(f"{object_store}/in.jsonl")
    app = create_app(make_config(), engine)
    assert asyncio.run(run_batch(app, requests, f"{object_store}/out.jsonl", None)) == 0
    answers = [json.loads(line) for line in _ObjectStore.files["/out.jsonl"].decode().splitlines()]
    assert [answer["custom_id"] for answer in answers] == ["a", "b"]
    with pytest.raises(BatchInputError, match="cannot read .*/missing.jsonl: .*404"):
        read_batch(f"{object_store}/missing.jsonl")
    _ObjectStore.failures = 3  # every try fails: the run fails, the answers kept locally
    with pytest.raises(UploadError, match="cannot upload the answers to .*; they are in ") as error:
        asyncio.run(run_batch(app, requests, f"{object_store}/out2.jsonl", None))
    assert "/out2.jsonl" not in _ObjectStore.files
    kept = Path(str(error.value).rsplit("they are in ", 1)[1])
    assert [json.loads(line)["custom_id"] for line in kept.read_text().splitlines()] == ["a", "b"]


def test_the_command_downloads_a_url_input_before_loading_the_model(object_store, monkeypatch):
    ran = []
    monkeypatch.setattr(
        "pagedserve.server.cli._run_batch", lambda args, config, batch: ran.append((args, batch))
    )
    _ObjectStore.files["/in.jsonl"] = (
        _line("a", "/v1/completions", {"prompt": "x"}) + "\n"
    ).encode()
    main(["run-batch", "-i", f"{object_store}/in.jsonl", "-o", f"{object_store}/out.jsonl"])
    [(args, batch)] = ran
    assert [request.custom_id for request in batch] == ["a"]
    for source, output in (
        (f"{object_store}/nothing.jsonl", "/tmp/x.jsonl"),  # a 404
        ("http://[::1/in.jsonl", "/tmp/x.jsonl"),  # not a URL
        (f"{object_store}/in.jsonl", "http://[::1/out.jsonl"),
    ):
        with pytest.raises(SystemExit) as exit_info:
            main(["run-batch", "-i", source, "-o", output])
        assert exit_info.value.code == 2


def test_the_body_limit_fits_the_largest_line_as_it_is_sent():
    # Non-ASCII text is sent as UTF-8 (3 bytes a character here), with ", " separators.
    batch = [
        BatchRequestInput.model_validate_json(_line("a", "/v1/completions", {"prompt": "天" * 10})),
        BatchRequestInput.model_validate_json(_line("b", "/v1/completions", {"prompt": [1, 2]})),
    ]
    assert _largest_body(batch) == len('{"prompt": "' + "天" * 10 + '"}') + 20
