"""The inference engine itself: launching a vLLM server with relayrl's worker extension
(`launcher`, `worker_extension`). The services reach an engine through `relayrl.inference`;
a worker receives versions through `relayrl.dataplane`."""
