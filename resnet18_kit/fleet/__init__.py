"""Several replicas of the embedded server behind HAProxy on one machine (`resnet18-kit fleet`).

  haproxy    the policy file's companion: servers file, `haproxy -c`, the process, the runtime API
  fleet      Fleet: the replicas (one Supervisor each) and HAProxy, restarts that lose nothing
  __main__   the command
"""
