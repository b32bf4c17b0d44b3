// The Gloo backend of sp_comm (the one C++ file of libshardplane).
#include <gloo/config.h>
