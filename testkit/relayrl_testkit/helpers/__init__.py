"""What the tests, the benches and their child processes share: process launchers and
fixtures' building blocks, scripts a test runs as a child (`python -m
relayrl_testkit.helpers.tq_workers ...`), and plug-ins a service loads by dotted path."""
