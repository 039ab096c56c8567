"""The stores of a round boundary: what a checkpoint holds (`store`), one workdir every host
shares (`shared_dir`, orbax), a workdir per host (`per_host`), where hosts with their own
disks resume and how one heals from a peer (`recovery`), and what another host count
changes (`resize`)."""
