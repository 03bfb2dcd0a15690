"""relayrl's test harness, apart from the product: the engine emulator
(`python -m relayrl_testkit.emulator`), the simulated vLLM judge
(`python -m relayrl_testkit.judge_sim`) and its launcher, and `relayrl_testkit.helpers`, what
the tests, the benches and their child processes share. Installed by `make setup`
(`pip install -e testkit`); never part of a service image."""

from pathlib import Path

# The repository checkout this test-kit is installed from (`make setup` installs it editable):
# what the helpers read beside the code (the chart, dashboards, the git tree).
REPO = Path(__file__).resolve().parents[2]
