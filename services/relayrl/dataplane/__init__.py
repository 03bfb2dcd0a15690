"""What both ends of weight-sync share, below `weightsync` (the service, the trainer's sender)
and `engine` (the worker extension that receives): the bucket plan codec (`plan`), FP8
quantisation (`quant`), delta encoding (`delta`), the request weight-sync sends each worker
(`request`), the receiving end (`receiver`), the table of data planes a version can travel
over (`data_planes`) and the byte transports behind the broadcast ones (`transports`).

Nothing here imports `relayrl.weightsync` or `relayrl.engine`."""
