// Transitional: moved to backends/common/host_identity.h.
#pragma once

#include "backends/common/host_identity.h"
