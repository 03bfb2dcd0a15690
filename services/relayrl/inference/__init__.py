"""The client side of an inference engine: the `EngineClient` seam through which the gateway,
weight-sync and `relayrl up` reach an engine replica, and its implementation over a vLLM
server's HTTP API (`client.VllmEngineClient`). Below the services; imports no other relayrl
package."""
