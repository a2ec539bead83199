"""domain/decommission.py without a database: what blocks a decommission, what its preview binds,
when an execution no longer matches its preview, and the events that end the node's stream."""

from __future__ import annotations

from datetime import timedelta

from hypothesis import given
from hypothesis import strategies as st

from domain.decommission import (
    NAMED_CHANGES,
    REVOKED_REASON,
    Dependencies,
    LifecycleChange,
    TelemetryDependency,
    blocked_detail,
    decommission_events,
    digest_of,
    lease_status,
    preview_is_stale,
    preview_of,
    stale_detail,
)
from domain.node import CredentialState, LeaseState, NodeState, NodeStatus
from ledger.events import CredentialRevoked, NodeDecommissioned
from tests.builders import T0

NOW = T0 + timedelta(hours=1)

# A lease's expiry, in minutes from NOW: None (held until released), past or future.
expiries = st.one_of(st.none(), st.integers(-120, 120))
leases = st.dictionaries(st.text("abcdef0123456789", min_size=1, max_size=6), expiries, max_size=6)
credentials = st.dictionaries(st.text("abcdef0123456789", min_size=1, max_size=6), st.booleans(), max_size=6)


def node(
    lease_expiries: dict[str, int | None],
    credential_revoked: dict[str, bool],
    *,
    generation: int = 3,
    status: NodeStatus = "active",
) -> NodeState:
    return NodeState(
        node_id="node-1",
        discovered=True,
        identity_key="key-1",
        hostname="h",
        status=status,
        lifecycle_version=generation,
        leases={
            lease_id: LeaseState(
                lease_id=lease_id,
                owner="scheduler",
                reason="job",
                acquired_at=T0 + timedelta(seconds=n),
                position=n,
                expires_at=None if minutes is None else NOW + timedelta(minutes=minutes),
            )
            for n, (lease_id, minutes) in enumerate(sorted(lease_expiries.items()))
        },
        credentials={
            credential_id: CredentialState(
                credential_id=credential_id,
                identity_key="key-1",
                hostname="h",
                secret_sha256="0" * 64,
                enrollment_token_id="t",
                issued_at=T0,
                position=1,
                revoked_at=T0 if revoked else None,
            )
            for credential_id, revoked in credential_revoked.items()
        },
    )


@given(leases, credentials, st.sampled_from(["active", "decommissioned"]))
def test_the_blockers_are_exactly_the_leases_active_now(
    lease_expiries: dict[str, int | None], credential_revoked: dict[str, bool], status: NodeStatus
) -> None:
    preview = preview_of(node(lease_expiries, credential_revoked, status=status), NOW)
    active = [k for k, minutes in sorted(lease_expiries.items()) if minutes is None or minutes > 0]
    assert [b.lease_id for b in preview.blockers] == active
    assert [x.lease_id for x in preview.dependencies.leases] == active
    assert preview.can_execute == (status == "active" and not active)
    live = sorted(k for k, revoked in credential_revoked.items() if not revoked)
    assert [c.credential_id for c in preview.dependencies.credentials] == live
    assert blocked_detail("node-1", preview.blockers).startswith(f"node node-1 has {len(active)} active")


@given(leases, credentials, st.integers(0, 50))
def test_the_digest_binds_the_generation_and_the_dependencies(
    lease_expiries: dict[str, int | None], credential_revoked: dict[str, bool], generation: int
) -> None:
    state = node(lease_expiries, credential_revoked, generation=generation)
    preview = preview_of(state, NOW)
    assert preview_of(state, NOW).digest == preview.digest  # the same state: the same digest
    assert preview.generation == generation
    assert not preview_is_stale(preview, generation, preview.digest)
    moved = preview_of(node(lease_expiries, credential_revoked, generation=generation + 1), NOW)
    assert moved.digest != preview.digest
    assert preview_is_stale(moved, generation, preview.digest)
    revoked_all = preview_of(node(lease_expiries, dict.fromkeys(credential_revoked, True)), NOW)
    if any(not revoked for revoked in credential_revoked.values()):
        assert revoked_all.digest != preview_of(node(lease_expiries, credential_revoked), NOW).digest


@given(st.lists(st.integers(0, 10**9), min_size=1, max_size=4))
def test_the_digest_ignores_when_a_telemetry_row_was_received(seconds: list[int]) -> None:
    def digest(offset: int) -> str:
        rows = [
            TelemetryDependency("hw_host_telemetry", "node-1", None, T0 + timedelta(seconds=s + offset))
            for s in seconds
        ]
        return digest_of("node-1", "active", 1, Dependencies([], [], [], rows), [])

    assert digest(0) == digest(17)
    fewer = Dependencies(
        [], [], [], [TelemetryDependency("hw_host_telemetry", "node-1")] * (len(seconds) - 1)
    )
    assert digest_of("node-1", "active", 1, fewer, []) != digest(0)


@given(st.integers(0, 20), st.integers(0, 20), st.booleans())
def test_an_execution_is_stale_unless_generation_and_digest_are_the_previews(
    previewed: int, current: int, same_digest: bool
) -> None:
    preview = preview_of(node({}, {}, generation=current), NOW)
    digest = preview.digest if same_digest else "f" * 64
    assert preview_is_stale(preview, previewed, digest) == (previewed != current or not same_digest)


@given(st.integers(0, 30))
def test_a_stale_refusal_names_the_first_changes_or_the_digests(changes: int) -> None:
    current = preview_of(node({}, {}, generation=5 + changes), NOW)
    moved = [LifecycleChange(5 + n, f"EVENT_{n}", NOW, None) for n in range(changes)]
    detail = stale_detail("node-1", 5, "a" * 64, current, moved)
    assert detail.endswith("; nothing was changed: preview again")
    named = [c.event_type for c in moved if f"{c.event_type} (v{c.stream_version})" in detail]
    assert named == [c.event_type for c in moved[:NAMED_CHANGES]]
    same_generation = stale_detail("node-1", current.generation, "a" * 64, current, [])
    assert f"digest {'a' * 12}… -> {current.digest[:12]}…" in same_generation


@given(credentials, st.integers(0, 50))
def test_the_tombstone_comes_last_after_revoking_every_live_credential(
    credential_revoked: dict[str, bool], generation: int
) -> None:
    preview = preview_of(node({}, credential_revoked, generation=generation), NOW)
    payloads = decommission_events(preview, generation, preview.digest, "retired", "operator:ana", NOW)
    live = sorted(k for k, revoked in credential_revoked.items() if not revoked)
    *revocations, tombstone = payloads
    assert revocations == [CredentialRevoked(credential_id=c, reason=REVOKED_REASON) for c in live]
    assert isinstance(tombstone, NodeDecommissioned)
    assert (tombstone.node_id, tombstone.generation, tombstone.digest) == (
        "node-1",
        generation,
        preview.digest,
    )
    assert (tombstone.actor, tombstone.reason, tombstone.decommissioned_at) == (
        "operator:ana",
        "retired",
        NOW,
    )
    assert tombstone.revoked_credentials == live


@given(st.one_of(st.none(), st.integers(-10, 10)))
def test_an_unreleased_lease_is_active_until_it_expires(minutes: int | None) -> None:
    expires = None if minutes is None else NOW + timedelta(minutes=minutes)
    assert lease_status(expires, NOW) == ("active" if minutes is None or minutes > 0 else "expired")
