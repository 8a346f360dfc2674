"""Protocol buffers of every Tidekv RPC (package ``tidekv.v1``).

The ``*.proto`` files here are the source of truth; ``python -m proto.build`` generates the
``*_pb2.py`` / ``*_pb2_grpc.py`` modules next to them (the install runs it; they are never
hand-edited nor committed).
"""
