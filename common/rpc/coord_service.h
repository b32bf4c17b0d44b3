/* The Coordinator service's name on the wire (proto/shardplane/v1/
 * coordinator.proto, package shardplane.v1) and its method paths: one
 * definition for the coordinator that serves them, the library and the
 * command that call them, and the health status reported under it. */
#ifndef SP_COORD_SERVICE_H
#define SP_COORD_SERVICE_H

#define SP_COORD_SERVICE "shardplane.v1.Coordinator"
/* ":path" of a method: SP_COORD_PATH("GetJob") */
#define SP_COORD_PATH(m) "/" SP_COORD_SERVICE "/" m

#endif
