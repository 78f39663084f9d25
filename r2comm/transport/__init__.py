"""Transports' cold paths: rail discovery, connection set-up and the links thread (links),
TCP listen/connect/handshake (tcp), shared-memory segments (shm), verbs devices and queue-pair
exchange (verbs), the registration cache (regcache). Their hot paths are Cython in r2comm._core
behind transport.pxd."""
