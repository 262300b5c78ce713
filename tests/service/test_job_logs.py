"""GET /v1/jobs/{id}/logs: the log's last lines, streamed, reading what it sends and not the
whole log (issue 47 item 7: a 524 MB log was read whole by each of 45 readers)."""

from __future__ import annotations

import io
from collections import deque
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from hypothesis import given
from hypothesis import strategies as st

from service import joblogs
from service_helpers import job_body, job_folder


def _bytes_read_by_this_process() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise AssertionError("no rchar in /proc/self/io")


def test_the_last_lines_of_a_large_log_cost_what_is_sent(
        client: TestClient, alice: dict[str, str], service_settings) -> None:
    client.app.state.settings.paused = True
    job_id = client.post("/v1/jobs", json=job_body(), headers=alice).json()["id"]
    log = joblogs.log_path(job_folder(client, service_settings.runs_dir, job_id))
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("wb") as out:
        out.write(b"old progress line\n" * 1_500_000)  # 27 MB
        out.write("".join(f"step {i} \u00b5\n" for i in range(5)).encode() + b"bad \xff end")
    before = _bytes_read_by_this_process()
    answer = client.get(f"/v1/jobs/{job_id}/logs?tail=3", headers=alice)
    read = _bytes_read_by_this_process() - before
    assert answer.status_code == 200
    assert answer.text == "step 3 \u00b5\nstep 4 \u00b5\nbad \ufffd end"
    assert answer.headers["content-type"].startswith("text/plain")
    assert read < 2_000_000, f"{read} bytes read for 3 lines of a 27 MB log"


@pytest.mark.parametrize("block", [1, 3, 64 * 1024])
@given(text=st.lists(st.binary(max_size=12).map(lambda b: b.replace(b"\n", b"")),
                     max_size=30).map(lambda lines: b"\n".join(lines)),
       final_newline=st.booleans(), lines=st.integers(1, 40))
def test_tail_gives_what_reading_every_line_gives(tmp_path_factory, block: int, text: bytes,
                                                  final_newline: bool, lines: int) -> None:
    folder = tmp_path_factory.mktemp("log")
    data = text + (b"\n" if final_newline and text else b"")
    joblogs.log_path(folder).write_bytes(data)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(joblogs, "TAIL_BLOCK_BYTES", block)
        sent = b"".join(joblogs.tail(folder, lines))
    expected = b"".join(deque(io.BytesIO(data), maxlen=lines))  # lines end at b"\n" only
    assert sent.decode() == expected.decode("utf-8", errors="replace")
