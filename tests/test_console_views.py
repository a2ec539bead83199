"""The console's pure presentation rules, without a server: how facts, ages, moments and events read."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import msgspec
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from api.http.console.views import age, form_moment, parse_moment, skew
from api.services.wording import (
    KNOWN_SIGNAL_NAMES,
    StreamView,
    event_lines,
    event_summary,
    fact_label,
    fact_view,
    human_bytes,
    signal_rows,
    stream_view,
    xid_meaning,
)
from collectors.facts import UNSUPPORTED, Known, TemporarilyFailed, Unavailable, Unknown
from collectors.gpu_health import CLOCK_EVENT_REASONS
from collectors.observations import (
    ACCELERATOR_INVENTORY_FACTS,
    ACCELERATOR_METRICS,
    DRIVER_FACTS,
    HOST_METRICS,
)
from domain.health import XID_RULES
from ledger.events import AcceleratorHealthChanged, HealthReason
from tests.builders import pending_remap

METRICS = [
    "fan_speed_percent",
    "utilization_gpu_percent",
    "temperature_celsius",
    "power_watts",
    "clock_sm_mhz",
    "memory_used_bytes",
    "performance_state",
]
reasons = st.text(min_size=1, max_size=40).filter(str.strip)
not_known = st.one_of(
    st.just(UNSUPPORTED),
    st.builds(Unknown),
    st.builds(Unavailable, reason=reasons),
    st.builds(TemporarilyFailed, reason=reasons),
)


@given(st.sampled_from(METRICS), not_known, st.integers(min_value=0, max_value=10**12))
def test_no_missing_reading_ever_reads_like_a_measured_value(metric: str, fact: object, value: int) -> None:
    missing = fact_view(metric, fact)  # type: ignore[arg-type]
    measured = fact_view(metric, Known(value))
    assert missing.state != "known" and measured.state == "known"
    assert missing.text != measured.text
    assert not any(ch.isdigit() for ch in missing.text), missing
    if isinstance(fact, Unavailable | TemporarilyFailed):
        assert missing.reason == fact.reason


def test_a_zero_is_shown_as_zero_with_its_unit() -> None:
    assert fact_view("fan_speed_percent", Known(0)).text == "0 %"
    assert fact_view("power_watts", Known(26.84)).text == "26.8 W"
    assert fact_view("temperature_celsius", Known(0)).text == "0 °C"
    assert fact_view("performance_state", Known(8)).text == "P8"
    assert fact_view("memory_used_bytes", Known(0)).text == "0 B"
    assert fact_view("fan_speed_percent", None).state == "unknown"
    assert fact_view("fan_speed_percent", UNSUPPORTED).text == "not supported"


@given(st.integers(min_value=0, max_value=2**50))
@example(1073689396)  # 1023.95 MiB: printed "1024.0 MiB" until the unit was chosen on the printed number
@example(1048524)  # the same edge one unit down
def test_bytes_use_binary_units_and_stay_short(n: int) -> None:
    text = human_bytes(n)
    number, unit = text.split(" ")
    assert unit in ("B", "KiB", "MiB", "GiB", "TiB")
    assert float(number) < 1024 or unit == "TiB"


@given(st.integers(min_value=0, max_value=10 * 86400))
def test_age_is_in_the_largest_whole_unit(seconds: int) -> None:
    now = datetime(2026, 12, 1, tzinfo=UTC)
    text = age(now - timedelta(seconds=seconds), now)
    count, unit, ago = text.split(" ")
    size = {"s": 1, "min": 60, "h": 3600, "d": 86400}[unit]
    assert ago == "ago" and int(count) == seconds // size and (seconds < 60 or int(count) >= 1)
    assert age(None, now) == "never" and age(now + timedelta(seconds=5), now) == "in the future"


@given(st.datetimes(min_value=datetime(2000, 1, 1), max_value=datetime(2100, 1, 1)))
def test_a_form_moment_reads_back_as_the_same_utc_second(moment: datetime) -> None:
    aware = moment.replace(tzinfo=UTC, microsecond=0)
    assert parse_moment(form_moment(aware)) == aware


def test_moments_without_offset_are_utc_and_bad_ones_say_what_is_expected() -> None:
    assert parse_moment("2026-12-01T02:10") == datetime(2026, 12, 1, 2, 10, tzinfo=UTC)
    assert parse_moment("2026-12-01T03:10+01:00") == datetime(2026, 12, 1, 2, 10, tzinfo=UTC)
    assert parse_moment("") is None and parse_moment(None) is None
    with pytest.raises(ValueError, match=r"expected e\.g\. 2026-12-01T02:10"):
        parse_moment("yesterday")


def test_changes_read_before_to_after() -> None:
    lines = event_summary(
        "HARDWARE_CHANGED",
        {
            "subject": "accelerator",
            "changes": {
                "pci_bus_id": {
                    "before": {"state": "known", "value": "0000:18:00.0"},
                    "after": {"state": "known", "value": "0000:2A:00.0"},
                },
                "index": {"before": {"state": "known", "value": 0}, "after": {"state": "unsupported"}},
            },
            "accelerator_uuid": "GPU-1",
        },
    )
    assert lines == ["index: 0 -> unsupported", "pci_bus_id: 0000:18:00.0 -> 0000:2A:00.0", "GPU GPU-1"]
    assert event_summary(
        "ACCELERATOR_MISSING", {"uuid": "GPU-2", "reason": "absent from a complete scan"}
    ) == [
        "reason: absent from a complete scan",
        "GPU GPU-2",
    ]


def test_a_telemetry_snapshot_says_how_many_gpus_it_sampled() -> None:
    sample = {"accelerator_id": "a", "uuid": "GPU-1", "telemetry": {}}
    assert event_summary(
        "NODE_TELEMETRY_OBSERVED", {"telemetry": {}, "storage": [], "accelerators": [sample] * 8}
    ) == ["telemetry of the host and 8 GPUs"]
    assert event_summary(
        "NODE_TELEMETRY_OBSERVED", {"telemetry": {}, "storage": [], "accelerators": [sample]}
    ) == ["telemetry of the host and 1 GPU"]


def test_health_events_read_as_sentences_not_as_data() -> None:
    lines = event_lines(
        "ACCELERATOR_HEALTH_CHANGED",
        AcceleratorHealthChanged(
            accelerator_id="a1",
            uuid="GPU-3",
            before="healthy",
            after="failed",
            action="service",
            reasons=[
                HealthReason("xid_79", "failed", "service", "XID 79: GPU has fallen off the bus"),
            ],
        ),
    )
    assert lines == [
        "health: healthy -> failed, action service",
        "reasons: xid_79 (XID 79: GPU has fallen off the bus)",
        "GPU GPU-3",
    ]
    assert event_summary("ACCELERATOR_XID_OBSERVED", {"uuid": "GPU-3", "code": 13, "at": "x"}) == [
        "XID 13: not in the health rules (usually a program's fault): recorded only",
        "GPU GPU-3",
    ]


def test_signal_rows_list_every_signal_once_in_the_documented_groups() -> None:
    from api.services.reads.bodies import HealthSignalsBody

    body = msgspec.convert(msgspec.to_builtins(pending_remap()), HealthSignalsBody)
    names = [name for name, _ in signal_rows(body)]
    assert len(names) == len(set(names)) == 1 + 4 + 4 + 3 + 1 + len(CLOCK_EVENT_REASONS) + 1
    assert names[:3] == ["ecc_mode", "ecc_errors.corrected_volatile", "ecc_errors.uncorrected_volatile"]
    assert dict(signal_rows(body))["remapped_rows.pending"] == Known(True)
    assert names[-1] == "xid_events"


@given(code=st.integers(0, 200))
def test_every_xid_has_a_meaning_and_the_rule_table_is_its_source(code: int) -> None:
    meaning = xid_meaning(code)
    assert meaning.startswith(f"XID {code}")
    assert (code in XID_RULES) == ("recorded only" not in meaning)


@pytest.mark.parametrize(
    "name",
    [
        *ACCELERATOR_METRICS,
        *HOST_METRICS,
        *ACCELERATOR_INVENTORY_FACTS,
        *DRIVER_FACTS,
        "ecc_mode",
        "pcie_replay_count",
        "xid_events",
        *KNOWN_SIGNAL_NAMES,
    ],
)
def test_every_fact_the_collectors_define_has_a_label_for_people(name: str) -> None:
    label = fact_label(name)
    assert "_" not in label and label[0].isupper() and label != name, label


def test_labels_read_as_nvidia_smi_names_them() -> None:
    assert fact_label("fan_speed_percent") == "Fan speed"
    assert fact_label("ecc_errors.uncorrected_volatile") == "ECC: uncorrected (volatile)"
    assert fact_label("clock_event_reasons.hw_thermal_slowdown") == "Clock event: HW thermal slowdown"
    # A name newer than this table still reads as words, never as the raw name.
    assert fact_label("nvlink_errors.crc_flit") == "Nvlink errors crc flit"


def test_a_stream_reads_as_its_node_or_as_what_else_it_is() -> None:
    from ledger.events import (
        HEALTH_POLICY_STREAM,
        WEBHOOKS_STREAM,
        decommission_audit_stream,
        enrollment_token_stream,
    )

    node = "aa144260-b7aa-51cd-a21e-d821a15cf0c6"
    assert stream_view(node) == StreamView("aa144260", node, node)
    token = enrollment_token_stream("76d4be55fba24e8e9da89c5f2943afb4")
    assert stream_view(token) == StreamView("token 76d4be55", token, None)
    audit = decommission_audit_stream(node)
    assert stream_view(audit) == StreamView("audit of aa144260", audit, node)
    assert stream_view(HEALTH_POLICY_STREAM).text == "health policy"
    assert stream_view(WEBHOOKS_STREAM).text == "webhooks"
    assert stream_view(HEALTH_POLICY_STREAM).node_id is None and stream_view(WEBHOOKS_STREAM).node_id is None


def test_the_events_off_a_node_say_what_they_did() -> None:
    created = {"token_id": "t1", "secret_sha256": "ab" * 32, "expires_at": "2026-12-04T05:56:25Z", "uses": 3}
    assert event_summary("ENROLLMENT_TOKEN_CREATED", {**created, "description": "rack 7"}) == [
        "3 uses, expires 2026-12-04T05:56:25Z",
        "description: rack 7",
    ]
    assert event_summary("ENROLLMENT_TOKEN_CREATED", {**created, "uses": 1, "description": ""}) == [
        "1 use, expires 2026-12-04T05:56:25Z"
    ]
    used = {"token_id": "t1", "node_id": "aa144260-b7aa", "credential_id": "c1"}
    assert event_summary("ENROLLMENT_TOKEN_USED", used) == ["enrolled node aa144260-b7aa"]
    policy = {"name": "strict-ecc", "digest": "d" * 64, "policy": {}}
    assert event_summary("HEALTH_POLICY_APPLIED", policy) == ["policy strict-ecc in force"]
    subscribed = {"subscription_id": "s1", "destination": "https://hooks.example:443", "url_sha256": "e" * 64}
    assert event_summary("WEBHOOK_SUBSCRIBED", {**subscribed, "event_types": [], "event_classes": []}) == [
        "to https://hooks.example:443"
    ]
    assert event_summary("WEBHOOK_RESUMED", {"subscription_id": "s1", "at_position": 42}) == [
        "resumed from position 42"
    ]
    said = [
        *event_summary("ENROLLMENT_TOKEN_CREATED", created),
        *event_summary("HEALTH_POLICY_APPLIED", policy),
        *event_summary("WEBHOOK_SUBSCRIBED", subscribed),
    ]
    assert not any(secret in line for line in said for secret in ("ab" * 32, "d" * 64, "e" * 64)), said


def test_gpus_read_in_index_order_one_without_an_index_last() -> None:
    from api.services.wording import gpu_ordered
    from domain.decommission import AcceleratorDependency

    gpus = [
        AcceleratorDependency("a", "GPU-a", "active", 3, "H200"),
        AcceleratorDependency("b", "GPU-b", "active", None, "H200"),
        AcceleratorDependency("c", "GPU-c", "active", 0, "H200"),
        AcceleratorDependency("d", "GPU-d", "active", 10, "H200"),
    ]
    assert [g.uuid for g in gpu_ordered(gpus)] == ["GPU-c", "GPU-a", "GPU-d", "GPU-b"]


def test_a_skew_that_rounds_to_nothing_has_no_sign() -> None:
    assert skew(-0.02) == "0.0 s" and skew(0.04) == "0.0 s"
    assert skew(-1.26) == "-1.3 s" and skew(2.0) == "2.0 s"
