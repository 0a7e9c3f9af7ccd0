"""What a client process's connection to a deployment is made of: the ``Connection`` the
client layers are handed, the controller client, the storage-unit clients (same host:
through shared memory), the spare rows, unit I/O, the read-only observer, and the
watches that end a call once its unit is lost or the deployment's owner is gone.
Imports nothing heavy: a server process may load it."""
