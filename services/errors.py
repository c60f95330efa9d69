"""Domain exceptions.

Each takes a single message string. torch RPC delivers a callee's exception to the caller as a
RuntimeError whose text starts with the type's name; ``services.remote.wait`` raises the types
defined here again as themselves, with the callee's name before the message.
"""


class RpcpsError(Exception):
    """Base of every error rpcps raises on purpose."""


class ConfigError(RpcpsError):
    """A flag or environment variable is invalid; the message names it."""


class BadRequest(RpcpsError):
    """A caller sent something a server cannot serve (wrong dtype, shape or id range)."""


class InvalidInput(BadRequest):
    """A well-formed request whose content does not fit what it feeds (a row against the schema);
    the message names the row and the column."""


class TooLarge(BadRequest):
    """A request over a size limit; the message gives the limit."""


class UpdateRefused(BadRequest):
    """A server refused an update (its values are not finite, or it is too large): nothing of it was applied."""


class StepLost(RpcpsError):
    """A training step failed on its way (a peer in the trainers' all-reduce died): nothing of it
    was applied, and the next step goes on."""


class ServerLost(StepLost):
    """A training step failed because a parameter server other than the leader went away (it
    died, was restarted, or stopped answering): nothing of the step counts, and the trainer waits
    for the server to come back. ``servers``: the servers lost."""

    def __init__(self, message: str, servers: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.servers = tuple(servers)


class Superseded(StepLost):
    """A request of an old incarnation of a member (one evicted from the group, or replaced by a
    newer start of its name): refused whole, so nothing of a fenced member lands after its
    replacement. The old incarnation learns it was evicted and leaves."""


class StaleLayout(StepLost):
    """A request planned with a layout older than the server's names a part it does not hold at
    its epoch (a slot or a dense group that moved): refused whole, nothing of it read or applied.
    The caller takes the leader's layout again and sends again. ``epoch``: the server's."""

    def __init__(self, message: str, epoch: int = 0) -> None:
        super().__init__(message)
        self.epoch = epoch


class InternalError(RpcpsError):
    """A method failed on a well-formed request: a bug on the serving side, logged there."""


class NotReady(RpcpsError):
    """The role has not joined the cluster or does not hold its model yet."""


class EpisodeConflict(RpcpsError):
    """An episode was started while one runs, or stopped while none does."""


class JoinRefused(RpcpsError):
    """The leader refused a join (for instance, the name belongs to a live member)."""


class Overloaded(RpcpsError):
    """More work is waiting than the role will queue: try again later."""


class PeerUnavailable(RpcpsError):
    """A peer that this role needs is gone or unreachable."""


class NotSupported(RpcpsError):
    """The role does not offer this operation."""


class CheckpointInProgress(RpcpsError):
    """A checkpoint was requested while another one is being taken."""


class CheckpointError(RpcpsError):
    """A checkpoint cannot be written, found or trusted."""


class Unauthorized(RpcpsError):
    """A control request without the right bearer token."""
