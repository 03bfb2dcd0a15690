"""The client side of an inference engine: the `EngineClient` seam through which the gateway,
weight-sync and `relayrl up` reach an engine replica, and its implementation over a vLLM
server's HTTP API (`client.VllmEngineClient`), bounded as `config.EngineHttpConfig` says.
Below the services; of relayrl it imports only `core` (config bases, socket options)."""
