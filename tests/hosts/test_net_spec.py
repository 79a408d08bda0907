"""The network fault spec (``_net.py``): parsing, rendering back, and the nftables rules
each fault becomes. Plain unit tests: no namespace, no root."""

from __future__ import annotations

import pytest

from ._net import NetFault, NetSpecError, nft_rules, parse_net

ADDR = {0: "10.0.0.1", 1: "10.0.0.2"}


def test_each_kind_parses() -> None:
    both, one, cut, loss, delay = parse_net(
        "partition 0<->1; partition 1->0 for 30s; partition 1->0:29400 for 2.5s; "
        "loss 0<->1 30%; delay 1->0:29400 200ms"
    )
    assert both == NetFault("partition", 0, 1, both=True)
    assert one == NetFault("partition", 1, 0, duration_s=30.0)
    assert (cut.port, cut.duration_s, cut.both) == (29400, 2.5, False)
    assert (loss.kind, loss.percent, loss.both) == ("loss", 30, True)
    assert (delay.kind, delay.delay_ms, delay.port) == ("delay", 200, 29400)


@pytest.mark.parametrize(
    "spec",
    [
        "partition 0<->1",
        "partition 1->0 for 30s",
        "partition 1->0:29400 for 2.5s",
        "loss 0<->1 30%",
        "loss 1->0 5% for 60s",
        "delay 1<->0:29400 200ms",
    ],
)
def test_render_round_trips(spec: str) -> None:
    (fault,) = parse_net(spec)
    assert fault.render() == spec
    assert parse_net(fault.render()) == [fault]


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        ("partiton 0<->1", "'partiton'"),
        ("partition 0<->0", "itself"),
        ("partition 0<->1 30%", "no amount"),
        ("loss 0<->1", "a percent"),
        ("loss 0<->1 130%", "1-100%"),
        ("delay 0<->1 200ms", "needs a port"),
        ("partition 0-1", "KIND A<->B"),
        ("partition 0->1:70000", "1-65535"),
        ("partition 0->1 for 0s", "> 0 s"),
        (" ; ", "names no fault"),
    ],
)
def test_bad_specs_say_what_is_wrong(spec: str, says: str) -> None:
    with pytest.raises(NetSpecError) as err:
        parse_net(spec)
    assert says in str(err.value) and "\n" not in str(err.value)


def test_partition_rules_drop_silently() -> None:
    (both,) = parse_net("partition 0<->1")
    assert nft_rules(both, ADDR) == [
        "ip saddr 10.0.0.1 ip daddr 10.0.0.2 drop",
        "ip saddr 10.0.0.2 ip daddr 10.0.0.1 drop",
    ]
    (one,) = parse_net("partition 1->0")
    assert nft_rules(one, ADDR) == ["ip saddr 10.0.0.2 ip daddr 10.0.0.1 drop"]
    rules = nft_rules(both, ADDR) + nft_rules(one, ADDR)
    assert not any("reject" in r for r in rules)  # a blackhole: no RST, no ICMP


def test_a_control_plane_cut_drops_both_directions_of_that_port_only() -> None:
    (cut,) = parse_net("partition 1->0:29400")
    assert nft_rules(cut, ADDR) == [
        "ip saddr 10.0.0.2 ip daddr 10.0.0.1 tcp dport 29400 drop",
        "ip saddr 10.0.0.1 ip daddr 10.0.0.2 tcp sport 29400 drop",
    ]


def test_loss_is_a_random_drop() -> None:
    (loss,) = parse_net("loss 1->0 30%")
    assert nft_rules(loss, ADDR) == [
        "ip saddr 10.0.0.2 ip daddr 10.0.0.1 numgen random mod 100 < 30 drop"
    ]
    (total,) = parse_net("loss 1->0 100%")
    assert nft_rules(total, ADDR) == ["ip saddr 10.0.0.2 ip daddr 10.0.0.1 drop"]


def test_delay_has_no_drop_rule_and_unknown_hosts_are_refused() -> None:
    (delay,) = parse_net("delay 1->0:29400 200ms")
    assert nft_rules(delay, ADDR) == []
    (far,) = parse_net("partition 0<->7")
    with pytest.raises(NetSpecError, match="no host 7"):
        nft_rules(far, ADDR)
