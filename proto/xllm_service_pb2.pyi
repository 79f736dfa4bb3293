from disagg.proto import disagg_pd_pb2 as _disagg_pd_pb2
from google.protobuf import descriptor as _descriptor
from typing import ClassVar as _ClassVar

DESCRIPTOR: _descriptor.FileDescriptor
