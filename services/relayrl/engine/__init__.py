"""The inference-engine side the gateway drives: launching a vLLM server with relayrl's
worker extension (`launcher`, `worker_extension`), and the `EngineClient` seam through which
the gateway reaches an engine (`client`)."""
