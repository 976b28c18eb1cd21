"""What crosses a process boundary between the supervisor, the host monitors and the
training processes: node and worker states and the name rule (`states`), the heartbeat
(`heartbeat`), the world a report belongs to and the refusal of an older one (`worlds`),
the error body of the HTTP APIs and its reader (`errors`), the emergency
checkpoint across nodes (`emergency`), the bodies of the host monitor's worker routes
(`worker_wire`), the supervisor's commands to host monitors (`node_commands`), checkpoint
reports and the checkpoint tiers (`checkpoint_reports`), the peer tier's bodies
(`peer_checkpoints`), fault kinds (`faults`), the workers' environment variable names
(`worker_env`), JSON numbers and times as the bodies' schemas have them (`json_types`),
TLS for the clients and servers of all three (`tls`), the retry rule every client waits
by (`backoff`) and the package's exception root (`exceptions`).

Each side imports these from here, so the two ends of a wire cannot drift apart; nothing
here imports the supervisor, the host monitor, the training side or the policies (an
import contract in pyproject.toml holds that).
"""
