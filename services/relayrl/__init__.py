"""relayrl: RL post-training for LLM agents as separately deployed gRPC services."""

__version__ = "0.1.0"
