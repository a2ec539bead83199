"""Hostile input on the agent side: a report the server refuses for good is quarantined and
the spool keeps flowing in order; `agent status` shows it; one agent per state directory.

Real agent processes throughout: against a stub HTTP server that refuses one report
deterministically (500 forever, or 422), and against the real server with a poisoned report in
the spool (a NUL in the hostname: PostgreSQL refuses it, so the server answers 400 or, before
it validated strings, 500 every time; either way the agent must get past it)."""

from __future__ import annotations

import hashlib
import json
import subprocess
import threading
import uuid
from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import pytest

from agent.spool import ANSWER_SUFFIX
from agent.state import CREDENTIAL_FILE, LOCK_FILE, SEQUENCES_FILE, Credential, save_credential
from domain.node import node_id_for
from ledger.db import create_pool
from tests.agent_support import (
    ROOT,
    AgentProcess,
    ServerProcess,
    create_token,
    observation,
    report_body,
    wait_for,
)
from tests.conftest import dsn_for_database

# --- a stub server that refuses one report deterministically ----------------------------------------


class StubServer:
    """Answers `poison_status` to the first report body it ever sees (every time it sees it) and
    200 `accepted` to every other report; records what it was sent, in order."""

    def __init__(self, poison_status: int) -> None:
        self.poison_status = poison_status
        self.poison: str | None = None
        self.seen: list[tuple[str, int, int]] = []  # (stream, sequence, answer)
        self.lock = threading.Lock()
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                digest = hashlib.sha256(body).hexdigest()
                report = json.loads(body)
                with stub.lock:
                    if stub.poison is None:
                        stub.poison = digest
                    status = stub.poison_status if digest == stub.poison else 200
                    stub.seen.append((report["stream"], report["sequence"], status))
                if status == 200:
                    answer = {"status": "accepted", "gap": 0}
                    ctype = "application/json"
                else:
                    answer = {"type": "about:blank", "title": "Refused by the stub", "status": status}
                    answer["detail"] = f"the stub refuses this report with {status}"
                    ctype = "application/problem+json"
                data = json.dumps(answer).encode()
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: Any) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def answers(self) -> list[tuple[str, int, int]]:
        with self.lock:
            return list(self.seen)


@pytest.fixture
def stub_factory() -> Iterator[Any]:
    stubs: list[StubServer] = []

    def make(status: int) -> StubServer:
        stub = StubServer(status)
        stub.thread.start()
        stubs.append(stub)
        return stub

    yield make
    for stub in stubs:
        stub.httpd.shutdown()
        stub.httpd.server_close()


def enrolled_without_a_server(state_dir: Path, identity_key: str, server: str) -> None:
    """What `agent enroll` leaves behind, written directly (the stub does not enroll)."""
    save_credential(
        state_dir,
        Credential(
            server=server,
            node_id=node_id_for(identity_key),
            identity_key=identity_key,
            credential_id=uuid.uuid4().hex,
            credential="mfc_" + uuid.uuid4().hex + "_stub-credential-not-a-secret",
            enrolled_at=datetime.now(UTC),
        ),
    )


def cli(agent: AgentProcess, *args: str) -> subprocess.CompletedProcess[str]:
    """`modelforge-hw agent ARGS` as this agent (its environment and state directory)."""
    return subprocess.run(
        agent.command(*args), env=agent.env(), cwd=ROOT, capture_output=True, text=True, timeout=60
    )


def agent_status(agent: AgentProcess) -> dict[str, Any]:
    done = cli(agent, "status", "--json")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)  # type: ignore[no-any-return]


def quarantined(agent: AgentProcess) -> dict[str, dict[str, Any]]:
    folder = agent.state_dir / "agent-quarantine"
    if not folder.exists():
        return {}
    return {
        p.name: json.loads((folder / (p.name + ANSWER_SUFFIX)).read_text())
        for p in sorted(folder.glob("*.json"))
        if not p.name.endswith(ANSWER_SUFFIX)
    }


def accepted_in_order(answers: list[tuple[str, int, int]]) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for stream, sequence, status in answers:
        if status == 200:
            out.setdefault(stream, []).append(sequence)
    return out


@pytest.mark.parametrize("status", [500, 422])
async def test_a_report_refused_for_good_is_quarantined_with_its_answer_and_the_spool_keeps_flowing(
    stub_factory: Any, tmp_path: Path, status: int
) -> None:
    stub = stub_factory(status)
    agent = AgentProcess(tmp_path, f"poison-{status}-{uuid.uuid4().hex[:6]}")
    enrolled_without_a_server(agent.state_dir, agent.node_id, stub.url)
    agent.start(extra=("--quarantine-after", "3"))
    try:

        async def flowing() -> bool:
            assert agent.alive(), agent.log_text()[-3000:]
            return sum(len(v) for v in accepted_in_order(stub.answers()).values()) >= 4

        await wait_for(flowing, 60, "four reports accepted after the poisoned one")
    finally:
        assert agent.stop() == 0, agent.log_text()[-3000:]

    answers = stub.answers()
    poisoned = [(s, q) for s, q, code in answers if code == status]
    # The first report (inventory 1) is the poisoned one: refused 3 times (500) or once (422).
    assert set(poisoned) == {("inventory", 1)}
    assert len(poisoned) == (3 if status == 500 else 1)
    # Then the reports behind it flowed, in order, none twice.
    accepted = accepted_in_order(answers)
    for sequences in accepted.values():
        assert sequences == sorted(set(sequences)), accepted
    # Nothing lost: every sequence the agent numbered was accepted, quarantined or is still spooled.
    kept = quarantined(agent)
    assert len(kept) == 1
    ((name, answer),) = kept.items()
    assert name.endswith("-inventory-1.json")
    assert answer["status"] == status and answer["attempts"] == len(poisoned)
    assert f"the stub refuses this report with {status}" in answer["answer"]
    body = json.loads((agent.state_dir / "agent-quarantine" / name).read_text())
    assert (body["stream"], body["sequence"]) == ("inventory", 1)
    numbered = json.loads((agent.state_dir / SEQUENCES_FILE).read_text())["streams"]
    spooled = {
        (p.name.split("-")[1], int(p.stem.split("-")[2]))
        for p in (agent.state_dir / "agent-spool").glob("*.json")
    }
    for stream, last in numbered.items():
        delivered = set(accepted.get(stream, [])) | {q for s, q in poisoned if s == stream}
        assert delivered | {q for s, q in spooled if s == stream} == set(range(1, last + 1)), stream

    log = agent.log_text()
    assert '"event": "agent.report_quarantined"' in log or '"event":"agent.report_quarantined"' in log, log[
        -3000:
    ]
    assert "Traceback" not in log
    status_view = agent_status(agent)
    assert status_view["quarantined"] == 1 and status_view["quarantined_total"] == 1
    assert status_view["last_error"]["status"] == status
    assert status_view["last_error"]["sequence"] == 1
    assert status_view["running_pid"] is None
    assert status_view["spooled"] == len(spooled)
    # The human form says the same.
    done = cli(agent, "status")
    assert done.returncode == 0
    assert "quarantined: 1" in done.stdout and f"HTTP {status}" in done.stdout
    assert f"spool depth: {len(spooled)}" in done.stdout


async def test_unavailable_answers_never_quarantine(stub_factory: Any, tmp_path: Path) -> None:
    """503 says the server is unavailable, not that the report is wrong: retried, kept, in order."""
    stub = stub_factory(503)
    agent = AgentProcess(tmp_path, f"unavailable-{uuid.uuid4().hex[:6]}")
    enrolled_without_a_server(agent.state_dir, agent.node_id, stub.url)
    agent.start(extra=("--quarantine-after", "2"))
    try:

        async def refused_often() -> bool:
            assert agent.alive(), agent.log_text()[-3000:]
            return sum(1 for _, _, code in stub.answers() if code == 503) >= 5

        await wait_for(refused_often, 60, "five 503 answers")
    finally:
        assert agent.stop() == 0, agent.log_text()[-3000:]
    assert quarantined(agent) == {}
    assert not accepted_in_order(stub.answers())  # the head of the spool still blocks, as it should
    assert agent.spooled() >= 1 and agent_status(agent)["last_error"]["status"] == 503


# --- the real server ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
async def plane_dsn(pg_server_dsn: str, template_database: str) -> AsyncIterator[str]:
    name = f"mf_test_{template_database[-12:]}_{uuid.uuid4().hex[:10]}"
    admin = await asyncpg.connect(pg_server_dsn)
    try:
        await admin.execute(f'CREATE DATABASE "{name}" TEMPLATE "{template_database}"')
    finally:
        await admin.close()
    yield dsn_for_database(pg_server_dsn, name)
    admin = await asyncpg.connect(pg_server_dsn)
    try:
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        await admin.close()


@pytest.fixture(scope="module")
async def server(plane_dsn: str, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[ServerProcess]:
    s = ServerProcess(plane_dsn, tmp_path_factory.mktemp("quarantine")).start()
    try:
        await s.wait_healthy()
        yield s
    finally:
        assert s.stop() == 0, s.log_text()[-4000:]


async def test_a_poisoned_report_in_the_spool_does_not_block_the_agent_against_the_real_server(
    server: ServerProcess, plane_dsn: str, tmp_path: Path
) -> None:
    agent = AgentProcess(tmp_path, f"nul-{uuid.uuid4().hex[:6]}")
    # A report PostgreSQL cannot store (a NUL in the hostname), left in the spool, e.g. by an older
    # agent: it is the first one sent.
    spool = agent.state_dir / "agent-spool"
    spool.mkdir(parents=True, mode=0o700)
    poison = report_body(agent.node_id, 1, stream="inventory", obs=observation(hostname="gpu\x00host"))
    (spool / "0000000000000000-inventory-1.json").write_bytes(poison)
    async with httpx.AsyncClient(timeout=15) as http:
        token = (await create_token(http, server.url))["token"]
    enrolled = await agent.enroll(server.url, token)
    assert enrolled.returncode == 0, enrolled.stderr
    agent.start(server.url, extra=("--quarantine-after", "3"))
    pool = await create_pool(plane_dsn, min_size=1, max_size=2)
    try:

        async def accepted() -> int:
            assert agent.alive(), agent.log_text()[-3000:]
            async with pool.acquire() as conn:
                rows = await conn.fetch(
                    "SELECT stream, last_sequence, reports FROM agent_stream_positions WHERE node_id = $1",
                    agent.expected_node_id,
                )
            return sum(int(r["reports"]) for r in rows)

        await wait_for(accepted, 60, "reports accepted behind the poisoned one")
        await wait_for(lambda: _async(len(quarantined(agent)) == 1), 30, "the poisoned report quarantined")
        async with httpx.AsyncClient(timeout=15) as http:
            from tests.agent_support import OPERATOR

            r = await http.get(
                f"{server.url}/api/v1/hardware/nodes/{agent.expected_node_id}", headers=OPERATOR
            )
            assert r.status_code == 200 and r.json()["liveness"] == "online", r.text
            assert "\x00" not in r.json()["hostname"]
    finally:
        assert agent.stop() == 0, agent.log_text()[-3000:]
        await pool.close()
    ((name, answer),) = quarantined(agent).items()
    assert name == "0000000000000000-inventory-1.json"
    assert answer["status"] == 400 and answer["attempts"] == 1, answer  # refused at once, not retried
    assert (agent.state_dir / "agent-quarantine" / name).read_bytes() == poison
    assert agent_status(agent)["quarantined"] == 1


async def _async(value: Any) -> Any:
    return value


# --- one agent per state directory --------------------------------------------------------------------


async def test_a_second_agent_on_the_same_state_directory_exits_at_once_naming_the_holder(
    stub_factory: Any, tmp_path: Path
) -> None:
    stub = stub_factory(422)  # the first report is quarantined; the rest are accepted
    first = AgentProcess(tmp_path, f"locked-{uuid.uuid4().hex[:6]}")
    enrolled_without_a_server(first.state_dir, first.node_id, stub.url)
    first.start()
    try:

        async def running() -> bool:
            assert first.alive(), first.log_text()[-3000:]
            return len(accepted_in_order(stub.answers()).get("telemetry", [])) >= 2

        await wait_for(running, 60, "the first agent reporting")
        assert first.proc is not None
        assert (first.state_dir / LOCK_FILE).read_text().strip() == str(first.proc.pid)
        assert agent_status(first)["running_pid"] == first.proc.pid
        credential_before = (first.state_dir / CREDENTIAL_FILE).read_bytes()
        seen_before = len(stub.answers())

        second = AgentProcess(tmp_path, first.node_id, state_dir=first.state_dir)
        for command in (
            ("run", "--interval", "0.3"),
            ("enroll", "--server", stub.url, "--token", "mfe_x", "--force"),
        ):
            done = cli(second, *command)
            assert done.returncode == 2, (command, done.stdout, done.stderr)
            message = done.stderr.strip().splitlines()
            assert len(message) == 1, done.stderr
            assert str(first.state_dir) in message[0] and f"pid {first.proc.pid}" in message[0], message
        assert (first.state_dir / CREDENTIAL_FILE).read_bytes() == credential_before

        async def still_flowing() -> bool:
            assert first.alive(), first.log_text()[-3000:]
            return len(stub.answers()) >= seen_before + 3

        await wait_for(still_flowing, 60, "the first agent still reporting")
    finally:
        assert first.stop() == 0, first.log_text()[-3000:]
    # The first agent's sequences were never disturbed: every stream accepted 1..n in order, once
    # (inventory 1 was the stub's refused report).
    for stream, sequences in accepted_in_order(stub.answers()).items():
        start = 2 if stream == "inventory" else 1
        assert sequences == list(range(start, start + len(sequences))), (stream, sequences)
    # Once it is gone (even by kill -9, the kernel drops the flock), the directory is free again.
    third = AgentProcess(tmp_path, first.node_id, state_dir=first.state_dir).start()
    try:
        assert third.proc is not None
        holder = str(third.proc.pid)

        async def holds() -> bool:
            assert third.alive(), third.log_text()[-3000:]
            return (first.state_dir / LOCK_FILE).read_text().strip() == holder

        await wait_for(holds, 30, "the third agent holding the state directory")
        third.proc.kill()
        third.proc.wait()
    finally:
        if third.alive():
            third.stop()
    again = AgentProcess(tmp_path, first.node_id, state_dir=first.state_dir)
    done = cli(again, "run", "--once")
    assert done.returncode == 0, done.stderr
