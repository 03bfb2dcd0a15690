"""What both ends of weight-sync share, below `weightsync` (the service, the trainer's sender)
and `engine` (the worker extension that receives): the bucket plan codec (`plan`), FP8
quantisation (`quant`), delta encoding (`delta`), the request weight-sync sends each worker
(`request`), the receiving end (`receiver`) and the data-plane transports (`transports`).

Nothing here imports `relayrl.weightsync` or `relayrl.engine`."""
