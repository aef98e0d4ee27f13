#pragma once
// The GPU side of `epx_fault_rank`: one fault case on an in-process world of this process, or
// this process's rank of an IpcWorld under `epx launch`. Each prints a `fault-result` line per
// surviving rank (fault_case.hpp) and a `fault-injected` line where the faulty rank fails.

#include "epx/bootstrap.hpp"
#include "fault_case.hpp"

namespace epx::fault {

// Every rank of the case in this process. Returns 0 when every survivor's verdict is pass, 1
// otherwise.
int run_in_process(const FaultCase& c);

// This process is rank env.rank of c.world (EPX_* from `epx launch`). A survivor returns 0 once
// it has printed its result, whatever the verdict in it (a survivor that exits with an error
// makes `epx launch` stop the others before they could report); it ends with 1 only when its
// stream hung. The faulty rank returns 0 once it has failed as planned (a killed one does not
// return), 1 when something else went wrong before its fault.
int run_ipc(const FaultCase& c, const BootstrapOptions& env);

// What the process is doing, for the watchdog's message (a string literal).
void set_stage(const char* stage);
const char* stage();

}  // namespace epx::fault
