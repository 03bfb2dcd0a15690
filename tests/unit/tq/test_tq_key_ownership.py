"""The TransferQueue's Redis key layout is private to relayrl.tq: no module outside
services/relayrl/tq/ may build one of its keys or read the queue's keys with raw Redis commands;
they call the queue's methods (events, dead letters, leases, consumer groups, the audit
snapshot, the pending watch). A test that corrupts or cross-checks raw state on purpose gets
the prefix from relayrl.tq.testing, which only tests may import. Static: every module is parsed,
none imported."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import relayrl.tq.queue

THIS = Path(__file__).resolve()
REPO = THIS.parents[3]
SCANNED = ("services", "testkit", "tests", "bench", "deploy", "examples")
TQ = REPO / "services" / "relayrl" / "tq"
TESTING = "relayrl.tq.testing"

# The queue's own key plumbing (relayrl.tq.base), public once as `key_prefix`.
KEY_HELPERS = frozenset(
    {
        "key_prefix",
        "_key_prefix",
        "_events_key",
        "_dead_key",
        "_partitions_key",
        "_partition_key_prefix",
    }
)
# Every key of a partition is "{<namespace>}:p:<partition>:<name>".
PARTITION_SEGMENT = ":p:"
# Redis commands that read or write the queue's streams, hashes and indexes. Only tq/ sends
# them (tests may, on keys they got from relayrl.tq.testing or from a SCAN of everything).
RAW_COMMANDS = frozenset(
    {
        "xread",
        "xreadgroup",
        "xrange",
        "xrevrange",
        "xinfo_groups",
        "xinfo_stream",
        "xpending",
        "xpending_range",
        "xlen",
        "xack",
        "xadd",
        "scan_iter",
        "zrange",
        "zrangebyscore",
        "zcard",
        "zrem",
        "hget",
        "hgetall",
        "hmget",
        "hset",
    }
)
RAW_COMMANDS_ALLOWED_IN = ("tests",)


def layout_names() -> set[str]:
    """The key names in relayrl.tq.queue's documented layout: "g:", "events", "partitions"..."""
    doc = relayrl.tq.queue.__doc__ or ""
    names = set(re.findall(r"^\s+\{ns\}:(?:p:<part>:)?([a-z]+:?)", doc, re.MULTILINE))
    assert {"events", "dead", "leases", "g:", "partitions"} <= names, names
    return names


KEY_NAMES = tuple(sorted(layout_names()))


def python_files() -> Iterator[Path]:
    for top in SCANNED:
        for path in sorted((REPO / top).rglob("*.py")):
            if "_pb2" in path.name or path.resolve() == THIS:
                continue
            if path.is_relative_to(TQ):
                continue
            yield path


def imports_testing(tree: ast.AST) -> bool:
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            names = {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
        elif isinstance(node, ast.Import):
            names = {alias.name for alias in node.names}
        else:
            continue
        if TESTING in names:
            return True
    return False


def _text(node: ast.AST) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def _key_name(node: ast.AST) -> str | None:
    """The literal if it starts with a key name of the layout ("events", "g:uid", ...)."""
    text = _text(node)
    return text if text is not None and text.startswith(KEY_NAMES) else None


MOD_KEY = re.compile(r"%s(" + "|".join(map(re.escape, KEY_NAMES)) + ")")


def built_keys(tree: ast.AST) -> Iterator[tuple[ast.AST, str]]:
    """Strings that put a key name of the layout after something computed: f"{prefix}events",
    prefix + "g:" + uid, "%sleases" % prefix."""
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):
            for before, part in zip(node.values, node.values[1:], strict=False):
                if isinstance(before, ast.FormattedValue) and (name := _key_name(part)):
                    yield node, f"f-string ...{name!r}"
        elif not isinstance(node, ast.BinOp):
            continue
        elif isinstance(node.op, ast.Add) and _text(node.left) is None:
            if name := _key_name(node.right):
                yield node, f"... + {name!r}"
        elif isinstance(node.op, ast.Mod) and (text := _text(node.left)) and MOD_KEY.search(text):
            yield node, f"{text!r} % ..."


def violations(source: str, where: str) -> list[str]:
    """Every way `source` (a module outside relayrl.tq, at `where` relative to the repo) reaches
    into the queue's keys."""
    tree = ast.parse(source, where)
    top = where.split("/", 1)[0]
    testing = imports_testing(tree)
    found = []

    def report(node: ast.AST, what: str) -> None:
        found.append(f"{where}:{getattr(node, 'lineno', '?')}: {what}")

    if testing and top != "tests":
        report(tree, f"imports {TESTING}, which is for tests only")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in KEY_HELPERS:
            report(node, f"uses the queue's key plumbing .{node.attr}")
        elif isinstance(node, ast.Name) and node.id in KEY_HELPERS:
            report(node, f"uses the queue's key plumbing {node.id}")
        elif isinstance(node, ast.alias) and node.name in KEY_HELPERS:
            report(node, f"imports the queue's key plumbing {node.name}")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if PARTITION_SEGMENT in node.value:
                report(node, f"spells a partition key: {node.value!r}")
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in RAW_COMMANDS
            and top not in RAW_COMMANDS_ALLOWED_IN
        ):
            command = node.func.attr.upper()
            report(node, f"sends {command} itself: the queue's keys are read through its methods")
    if not testing:  # a test with raw access on purpose builds keys from the testing prefix
        for node, what in built_keys(tree):
            report(node, f"builds a queue key: {what}")
    return found


def test_no_module_outside_tq_builds_or_reads_the_queues_keys() -> None:
    checked, found = 0, []
    for path in python_files():
        where = path.relative_to(REPO).as_posix()
        found += violations(path.read_text(), where)
        checked += 1
    assert checked > 300, f"only {checked} modules found under {SCANNED}"  # not vacuous
    assert found == [], "\n".join(found)


def test_only_tests_import_the_raw_key_prefix() -> None:
    for top in ("services", "testkit", "bench"):
        assert violations(f"from {TESTING} import key_prefix_for_tests\n", f"{top}/x.py")
    assert violations(f"from {TESTING} import key_prefix_for_tests\n", "tests/x.py") == []


def test_the_check_catches_every_way_of_reaching_a_key() -> None:
    bad = {
        "tq.key_prefix(p)": "key plumbing .key_prefix",
        "tq._key_prefix(p)": "key plumbing ._key_prefix",
        "tq._events_key(p)": "key plumbing ._events_key",
        "from relayrl.tq.base import _partition_key_prefix": "key plumbing _partition_key_prefix",
        'f"{prefix}events"': "builds a queue key: f-string ...'events'",
        'f"{prefix}dead"': "builds a queue key",
        'f"{prefix}leases"': "builds a queue key",
        'f"{prefix}g:{uid}"': "builds a queue key: f-string ...'g:'",
        'f"{prefix}g:*"': "builds a queue key",
        'prefix + "gs:pending"': "builds a queue key: ... + 'gs:pending'",
        '"%sevents" % prefix': "builds a queue key",
        'f"{{{ns}}}' + PARTITION_SEGMENT + '{p}:"': "spells a partition key",
        '"{relayrl}' + PARTITION_SEGMENT + 'train:events"': "spells a partition key",
        "tq.redis.xrevrange(stream, count=1)": "sends XREVRANGE itself",
        "client.xread({stream: last}, block=1000)": "sends XREAD itself",
        "tq.redis.scan_iter(pattern)": "sends SCAN_ITER itself",
        "tq.redis.xinfo_groups(stream)": "sends XINFO_GROUPS itself",
    }
    for source, expected in bad.items():
        found = violations(source + "\n", "services/relayrl/x.py")
        assert any(expected in v for v in found), (source, found)
    fine = [
        'parser.add_parser("events", help="the last transitions")',
        'result["events"] = [e for e in events]',
        'f"{n} events, {m} dead letters"',
        'f"{name}-events"',
        "tq.last_events(partition, 20)",
        "tq.dead_letters(partition)",
        "tq.audit_snapshot(partition)",
        '"g:" + uid',  # a constant on the left: not something computed
    ]
    for source in fine:
        assert violations(source + "\n", "services/relayrl/x.py") == [], source


def test_the_documented_layout_names_every_key_the_scripts_use() -> None:
    """The check above is only as good as the layout it knows (relayrl.tq.queue's docstring)."""
    used = set()
    for script in sorted((TQ / "lua").glob("*.lua")):
        used |= set(re.findall(r"\bP \.\. '([a-z]+:?)", script.read_text()))
    assert used, "no keys found in the scripts: the pattern is stale"
    assert used <= set(KEY_NAMES), sorted(used - set(KEY_NAMES))
