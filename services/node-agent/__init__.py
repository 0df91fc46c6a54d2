"""tessera-node-agent: device discovery, device plugin, container regions."""
