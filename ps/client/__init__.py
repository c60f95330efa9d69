"""The trainers' side of the parameter servers: the client, its step protocol and its lookups.
It imports the servers' declared surface, never the server."""
