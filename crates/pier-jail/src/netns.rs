//! The jail's network: a namespace of its own with only loopback, where the one listener
//! on [`PROXY_PORT`] belongs to pier. The helper binds it inside the namespace and sends the
//! descriptor over the control socket; pier accepts on it from its own namespace, so every
//! connection the agent makes to the proxy arrives in pier, which alone can reach out.

use std::io::IoSlice;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

use nix::sys::socket::{ControlMessage, ControlMessageOwned, MsgFlags, recvmsg, sendmsg};

use crate::spec::{CONTROL_FD, PROXY_PORT};

/// In the helper, inside the new network namespace (loopback up): the proxy's port bound,
/// the listener sent to pier, the control socket closed.
pub(crate) fn hand_over_proxy_port() -> Result<(), String> {
    let listener = std::net::TcpListener::bind(("127.0.0.1", PROXY_PORT))
        .map_err(|e| format!("cannot bind the proxy's port in the jail: {e}"))?;
    let fds = [listener.as_raw_fd()];
    sendmsg::<()>(CONTROL_FD, &[IoSlice::new(b"L")], &[ControlMessage::ScmRights(&fds)], MsgFlags::empty(), None)
        .map_err(|e| format!("cannot hand the proxy's listener to pier: {e}"))?;
    // The agent must hold neither the control socket nor the listener.
    // SAFETY: descriptor 3 was handed to this process by pier for this use alone.
    #[allow(unsafe_code)]
    drop(unsafe { OwnedFd::from_raw_fd(CONTROL_FD) });
    Ok(())
}

/// In pier: reads the listener the helper sent on `control` (a blocking read; run it off the runtime).
pub(crate) fn receive_listener(control: &OwnedFd) -> Result<std::net::TcpListener, String> {
    let mut byte = [0u8; 1];
    let mut io = [std::io::IoSliceMut::new(&mut byte)];
    let mut space = nix::cmsg_space!([RawFd; 1]);
    let msg = recvmsg::<()>(control.as_raw_fd(), &mut io, Some(&mut space), MsgFlags::MSG_CMSG_CLOEXEC)
        .map_err(|e| format!("cannot read the jail's proxy listener: {e}"))?;
    let cmsgs = msg.cmsgs().map_err(|e| format!("cannot read the jail's proxy listener: {e}"))?;
    for cmsg in cmsgs {
        if let ControlMessageOwned::ScmRights(fds) = cmsg
            && let Some(fd) = fds.first()
        {
            // SAFETY: the kernel just installed this descriptor in pier for this message.
            #[allow(unsafe_code)]
            let listener = unsafe { std::net::TcpListener::from_raw_fd(*fd) };
            return Ok(listener);
        }
    }
    Err("the jail ended before it handed over its proxy listener (its stderr says why)".into())
}

/// Brings `lo` up: a new network namespace starts with it down, and 127.0.0.1 unassigned.
#[allow(unsafe_code)]
pub(crate) fn loopback_up() -> Result<(), String> {
    use nix::sys::socket::{AddressFamily, SockFlag, SockType, socket};
    let sock = socket(AddressFamily::Inet, SockType::Datagram, SockFlag::SOCK_CLOEXEC, None)
        .map_err(|e| format!("cannot open a socket in the jail: {e}"))?;
    // SAFETY: ifreq is plain old data; all zeroes is a valid value.
    let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
    for (dst, src) in req.ifr_name.iter_mut().zip(b"lo\0") {
        *dst = *src as libc::c_char;
    }
    // SAFETY: SIOCGIFFLAGS/SIOCSIFFLAGS read and write the `ifreq` we own, nothing else.
    unsafe {
        if libc::ioctl(sock.as_raw_fd(), libc::SIOCGIFFLAGS as _, &mut req) < 0 {
            return Err(format!("cannot read loopback's flags: {}", std::io::Error::last_os_error()));
        }
        req.ifr_ifru.ifru_flags |= (libc::IFF_UP | libc::IFF_RUNNING) as libc::c_short;
        if libc::ioctl(sock.as_raw_fd(), libc::SIOCSIFFLAGS as _, &req) < 0 {
            return Err(format!("cannot bring loopback up in the jail: {}", std::io::Error::last_os_error()));
        }
    }
    Ok(())
}
