"""Generated protobuf / gRPC code for relayrl's v1 contracts (sources: `protos/`).

Import messages from their area, e.g. `from relayrl.proto.common.v1 import common_pb2`.
Importing this package from a source checkout fails when the generated code is stale.
"""

from relayrl.core.protogen import verify

verify()
