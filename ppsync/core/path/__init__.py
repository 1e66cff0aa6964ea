"""The token path: one rank's step protocol (the roles' calls, the
generations, the ring) over its end of the token group (its transfers,
waits, failures, handshake and close)."""
