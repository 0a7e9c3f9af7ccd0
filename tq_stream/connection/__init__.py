"""What a client process's connection to a deployment is made of: the controller client,
the storage-unit clients (same host: through shared memory), the spare rows, unit I/O
and the read-only observer. Imports nothing heavy: a server process may load it."""
