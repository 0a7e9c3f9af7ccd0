"""Typed messages: each RPC's request struct, reply type and flags, declared once.

``rpc.py`` (``Rpc``, ``RpcTable``); one module per family of methods: ``puts``
(partitions, reserve, commit, spares), ``reads`` (steps, acks, tasks, rows by key),
``admin`` (the deployment), ``media`` (media pins), ``unit`` (a storage unit's RPC).
A service builds its table from the families it serves (``deploy/services.py``,
``deploy/unit_service.py``); clients send a request struct and decode the reply with
the same ``Rpc`` (``connection/proxies.py``, ``connection/unit_calls.py``).
"""
